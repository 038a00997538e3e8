"""A launched SGLang server (``python -m sglang.launch_server``): its own process group and log
file, readiness, the HTTP endpoints a benchmark polls, and the kill of every server still up.

Stdlib only (no aiohttp, no sglang import). ``start_server`` registers the process in a list of
live servers; ``kill_group`` removes it and ``kill_all`` (for exit paths and hard timeouts)
kills whatever is left.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

from benchmark.harness import counters, engine_proc


def http_call(host: str, port: int, method: str, path: str, body: Any = None,
              timeout: float = 30.0) -> Tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def get_json(host: str, port: int, path: str, timeout: float = 30.0) -> Optional[Any]:
    try:
        status, body = http_call(host, port, "GET", path, timeout=timeout)
        return json.loads(body) if status == 200 else None
    except (OSError, ValueError, http.client.HTTPException):
        return None


_LIVE: List[subprocess.Popen] = []  # every server still to kill


@dataclass
class Server:
    name: str
    cmd: List[str]
    log_path: Path
    host: str
    port: int
    proc: Optional[subprocess.Popen] = None
    ready_s: Optional[float] = None
    ready_at: int = 0  # log size when it became ready: the serving part of the log starts here

    def get(self, path: str, timeout: float = 30.0) -> Optional[Any]:
        return get_json(self.host, self.port, path, timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def status(self, path: str, timeout: float = 60.0) -> Optional[int]:
        try:
            return http_call(self.host, self.port, "GET", path, timeout=timeout)[0]
        except (OSError, http.client.HTTPException):
            return None

    def loads(self) -> Optional[Dict[str, Any]]:
        """Rank 0's core load snapshot (num_used_tokens, token_usage, running, waiting)."""
        res = self.get("/v1/loads?include=core", timeout=10)
        loads = (res or {}).get("loads") or []
        return loads[0] if loads else None

    def info(self) -> Optional[Dict[str, Any]]:
        return self.get("/server_info", timeout=30)

    def granikv(self) -> Optional[Dict[str, Any]]:
        return counters.granikv_of(self.info() or {})

    def metrics(self) -> Dict[str, float]:
        try:
            status, body = http_call(self.host, self.port, "GET", "/metrics", timeout=30)
        except (OSError, http.client.HTTPException):
            return {}
        return parse_metrics(body.decode(errors="replace")) if status == 200 else {}


def free_port(preferred: int) -> int:
    for port in range(preferred, preferred + 50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError(f"no free port in [{preferred}, {preferred + 50})")


def start_server(server: Server, env: Dict[str, str]) -> None:
    log = open(server.log_path, "wb")
    # Own process group: the scheduler / detokenizer children are killed with it.
    server.proc = subprocess.Popen(server.cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    log.close()
    _LIVE.append(server.proc)


def wait_ready(server: Server, timeout: float) -> float:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if not server.alive():
            raise RuntimeError(f"{server.name} server exited with status {server.proc.returncode} "
                               f"before it was ready; log tail:\n{tail(server.log_path, 30)}")
        if server.status("/health_generate", timeout=10) == 200:
            server.ready_s = round(time.time() - t0, 1)
            server.ready_at = log_size(server.log_path)
            return server.ready_s
        time.sleep(1.0)
    raise RuntimeError(f"{server.name} server not ready after {timeout:.0f} s; log tail:\n"
                       f"{tail(server.log_path, 30)}")


def kill_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the server's process group, SIGKILL it after ``grace_s``; no longer live."""
    engine_proc.kill_group(proc, grace_s)
    try:
        _LIVE.remove(proc)
    except ValueError:  # already removed (the hard-timeout thread and main both kill)
        pass


def kill_all() -> None:
    for proc in list(_LIVE):
        kill_group(proc, grace_s=2.0)


def tail(path: Path, n: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def read_log(path: Path, start: int = 0, upto: Optional[int] = None) -> List[str]:
    """Lines of bytes [start, upto) of a log (start: a line start, e.g. the size at a time)."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(upto - start) if upto is not None else f.read()
    except OSError:
        return []
    return data.decode(errors="replace").splitlines()


def log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def metric_samples(text: str) -> Iterator[Tuple[str, str, float]]:
    """Prometheus text format -> (metric name, label string or "", value) per sample line."""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)", line)
        if not m:
            continue
        try:
            value = float(m[3])
        except ValueError:
            continue
        yield m[1], m[2] or "", value


def parse_metrics(text: str) -> Dict[str, float]:
    """Prometheus text format -> {metric name: sum over its label sets}."""
    out: Dict[str, float] = {}
    for name, _, value in metric_samples(text):
        out[name] = out.get(name, 0.0) + value
    return out
