"""The quickstart (docs/gpu_quickstart.md) as a user runs it, checked: serve, generate, /metrics,
shut down.

    python3 -m benchmark.smoke --out /tmp/granikv-smoke [--backend flashinfer]

1. ``python -m sglang.launch_server --model-path DIR --load-format dummy --attention-backend X
   --enable-granikv --enable-metrics --port P`` (DIR: the shipped Llama-3.1-8B config and a
   word-level tokenizer, harness.model_config.write_model_dir, so that text prompts work; the engine arguments
   every benchmark here uses are added: pytorch sampling, no grammar backend);
2. one ``/generate`` with a long shared text (it caches the prefix), then ``SHARERS`` concurrent
   ``/generate`` calls of that text plus a private suffix each;
3. ``/metrics``: ``granikv:hot_extents`` > 0 (the prefix was promoted) and
   ``granikv:decode_steps_total{path="cascade"}`` > 0 (decode steps ran the shared-prefix path),
   and every ``/generate`` returned its ``max_new_tokens`` tokens;
4. SIGTERM to the server; it must exit within ``SHUTDOWN_GRACE_S``.

With ``--backend default`` no ``--attention-backend`` is passed (the quickstart's shortest
form): the server log must then name the backend GraniKV chose (``default_backend_check``: one of
its default choices, flashinfer or triton, not SGLang's per-GPU default).

Writes ``smoke.json`` (every check with its value) and the server log into ``--out``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from benchmark.harness import engine_proc, server_proc
from benchmark.harness.model_config import write_model_dir

PREFIX_WORDS = 8192  # the shared text: long enough that GraniKV promotes it and cascade pays
SHARERS = 32
SUFFIX_WORDS = 64
MAX_NEW_TOKENS = 64
READY_TIMEOUT_S = 300.0
SHUTDOWN_GRACE_S = 60.0


def metric_values(text: str, name: str) -> Dict[str, float]:
    """Prometheus text -> {label string: value} of one metric (``""`` for no labels)."""
    out: Dict[str, float] = {}
    for n, labels, value in server_proc.metric_samples(text):
        if n == name:
            out[labels] = out.get(labels, 0.0) + value
    return out


#: ``--backend`` value that passes no ``--attention-backend`` (GraniKV then chooses one).
DEFAULT = "default"


def server_command(model_dir: Path, port: int, backend: str) -> List[str]:
    given = [] if backend == DEFAULT else ["--attention-backend", backend]
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--load-format", "dummy",
            *given, "--enable-granikv", "--enable-metrics", "--port", str(port),
            "--host", "127.0.0.1", "--sampling-backend", "pytorch", "--grammar-backend", "none",
            "--disable-prefill-cuda-graph", "--cuda-graph-max-bs-decode", str(SHARERS),
            "--mem-fraction-static", "0.8"]


def words(lo: int, n: int) -> str:
    return " ".join(f"t{lo + i}" for i in range(n))


def generate(server: server_proc.Server, text: str) -> Dict[str, Any]:
    body = dict(text=text, sampling_params=dict(max_new_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True))
    status, data = server_proc.http_call(server.host, server.port, "POST", "/generate", body, timeout=300)
    if status != 200:
        raise RuntimeError(f"/generate answered {status}: {data[:300]!r}")
    return json.loads(data)


def checks_of(metrics_text: str, outputs: Sequence[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """The smoke checks on a /metrics scrape and the /generate answers: name -> value, passed."""
    hot = sum(metric_values(metrics_text, "granikv:hot_extents").values())
    steps = metric_values(metrics_text, "granikv:decode_steps_total")
    cascade = sum(v for k, v in steps.items() if 'path="cascade"' in k)
    tokens = [int((o.get("meta_info") or {}).get("completion_tokens", -1)) for o in outputs]
    fills = metric_values(metrics_text, "granikv:work_list_fills_total")
    in_graph = sum(v for k, v in fills.items() if 'kind="ends_in_graph"' in k)
    return {
        "hot_extents": dict(value=hot, passed=hot > 0),
        "cascade_decode_steps": dict(value=cascade, paths=steps, passed=cascade > 0),
        # the cascade graph replays copied their suffix ends themselves (SGLang's in-graph hook)
        "ends_in_graph_steps": dict(value=in_graph, passed=in_graph > 0),
        "completion_tokens": dict(value=sorted(set(tokens)), passed=bool(tokens) and all(t == MAX_NEW_TOKENS
                                                                                     for t in tokens)),
    }


METRIC_CHECKS = ("hot_extents", "cascade_decode_steps", "ends_in_graph_steps", "completion_tokens")  # checks_of


def check_names(backend: str) -> set:
    """Every check a passing smoke on ``backend`` has made (a missing one fails it)."""
    return set(METRIC_CHECKS) | {"clean_shutdown"} | ({"default_backend_line"} if backend == DEFAULT else set())


def default_backend_check(log_text: str) -> Dict[str, Any]:
    """The server log's line of the backend GraniKV chose with no ``--attention-backend``: it
    must name one of the backends it chooses from (``DEFAULT_CHOICES``: verified, not fa3)."""
    from granikv.server_settings import DEFAULT_CHOICES

    marker = "no --attention-backend given: serving with "
    line = next((ln for ln in log_text.splitlines() if marker in ln), None)
    chosen = None if line is None else line.split(marker, 1)[1].split(",", 1)[0].split()[0]
    return dict(value=chosen, passed=chosen in DEFAULT_CHOICES)


def run_smoke(out: Path, *, backend: str = "flashinfer", port: int = 31000) -> Dict[str, Any]:
    """Runs the quickstart; returns ``{"passed", "checks", ...}`` (also written to smoke.json)."""
    out.mkdir(parents=True, exist_ok=True)
    model_dir = write_model_dir("llama-3.1-8b", str(out / "model"), tokenizer=True)
    port = server_proc.free_port(port)
    server = server_proc.Server(name="smoke", cmd=server_command(model_dir, port, backend),
                                log_path=out / "server.log", host="127.0.0.1", port=port)
    res: Dict[str, Any] = dict(command=" ".join(server.cmd), backend=backend)
    server_proc.start_server(server, engine_proc.engine_env("flashinfer" if backend == DEFAULT else backend))
    try:
        res["ready_s"] = server_proc.wait_ready(server, READY_TIMEOUT_S)
        prefix = words(1000, PREFIX_WORDS)
        outputs = [generate(server, prefix + " " + words(20000, 8))]
        t = time.time()
        with concurrent.futures.ThreadPoolExecutor(SHARERS) as pool:
            outputs += list(pool.map(lambda i: generate(server, f"{prefix} {words(30000 + 100 * i, SUFFIX_WORDS)}"),
                                     range(SHARERS)))
        res["generate_s"] = round(time.time() - t, 2)
        status, body = server_proc.http_call(server.host, server.port, "GET", "/metrics", timeout=30)
        text = body.decode(errors="replace") if status == 200 else ""
        (out / "metrics.txt").write_text(text)
        res["checks"] = checks_of(text, outputs)
        if backend == DEFAULT:
            res["checks"]["default_backend_line"] = default_backend_check(
                (out / "server.log").read_text(errors="replace"))
        res["granikv"] = server.granikv()
    finally:
        t = time.time()
        if server.proc is not None and server.proc.poll() is None:
            server.proc.send_signal(signal.SIGTERM)
            try:
                server.proc.wait(timeout=SHUTDOWN_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        clean = server.proc is not None and server.proc.poll() is not None
        res.setdefault("checks", {})["clean_shutdown"] = dict(value=round(time.time() - t, 1), passed=clean,
                                                             returncode=server.proc.poll() if server.proc else None)
        server_proc.kill_group(server.proc, grace_s=2.0)
    res["passed"] = all(c["passed"] for c in res["checks"].values()) and set(res["checks"]) == check_names(backend)
    (out / "smoke.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    for name, c in res["checks"].items():
        print(f"smoke {name}: {c['value']} {'ok' if c['passed'] else 'FAILED'}", flush=True)
    return dict(passed=res["passed"], checks={k: dict(value=v["value"], passed=v["passed"])
                                              for k, v in res["checks"].items()})


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/granikv-smoke")
    p.add_argument("--backend", default="flashinfer",
                   help=f"--attention-backend of the server; {DEFAULT!r}: none given (GraniKV chooses).")
    args = p.parse_args(argv)
    return 0 if run_smoke(Path(args.out), backend=args.backend)["passed"] else 1


if __name__ == "__main__":
    engine_proc.exit_after(main)
