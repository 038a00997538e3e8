"""The soak's HTTP client: streamed ``/generate`` requests with the three kinds of abort, one
batched ``/generate``, and the edge inputs plain SGLang must answer the same way with GraniKV on.

Stdlib only: ``http.client`` over one socket per request, so a client-side abort is a real
closed connection.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from benchmark.harness.model_config import model_config_path
from benchmark.harness.server_proc import Server, http_call

if TYPE_CHECKING:
    from benchmark.reliability.soak_load import SoakRequest


READ_TIMEOUT_S = 90.0  # per socket read of a soak request (queueing included)


@dataclass
class Outcome:
    idx: int
    status: str  # served | aborted | error
    abort: Optional[str] = None
    abort_late: bool = False  # the request finished before its planned abort (counted served)
    http_status: Optional[int] = None
    chunks: int = 0
    output_ids: List[int] = field(default_factory=list)
    finish: Optional[str] = None
    error: Optional[str] = None
    ttft_s: Optional[float] = None
    latency_s: float = 0.0


def _hard_close(conn: http.client.HTTPConnection, sock: Optional[socket.socket]) -> None:
    """Close the client side at once (FIN now, not when the GC gets to the response)."""
    for s in (sock, conn.sock):
        if s is not None:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
    conn.close()


def _finish_type(meta: Optional[Dict[str, Any]]) -> Optional[str]:
    """``meta_info.finish_reason`` as its type string (SGLang sends a dict or a string)."""
    finish = (meta or {}).get("finish_reason")
    return finish.get("type") if isinstance(finish, dict) else finish


def stream_generate(host: str, port: int, req: SoakRequest, prompt: Sequence[int], rid: str, *,
                    incremental: bool, timeout: float = READ_TIMEOUT_S) -> Outcome:
    """One streamed ``/generate``; aborts it as ``req.abort`` says; validates a served one."""
    out = Outcome(idx=req.idx, status="error", abort=req.abort)
    payload = {"input_ids": list(prompt), "rid": rid, "stream": True,
               "sampling_params": {"max_new_tokens": req.max_new_tokens, "temperature": 0,
                                   "ignore_eos": True}}
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    sock = None
    try:
        conn.request("POST", "/generate", body=json.dumps(payload).encode(),
                     headers={"Content-Type": "application/json"})
        sock = conn.sock
        if req.abort == "before_first_token":
            _hard_close(conn, sock)
            out.status = "aborted"
            return out
        resp = conn.getresponse()
        out.http_status = resp.status
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return out
        abort_sent = False
        if req.abort == "endpoint" and req.abort_after == 0:
            abort_sent = _abort_endpoint(host, port, rid, out)
        last: Optional[Dict[str, Any]] = None
        done = False
        for raw in iter(resp.readline, b""):
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            msg = json.loads(data)
            if "error" in msg:
                out.error = f"error chunk: {json.dumps(msg['error'])[:200]}"
                if req.abort == "endpoint" and abort_sent:
                    out.status = "aborted"
                return out
            if out.ttft_s is None:
                out.ttft_s = time.perf_counter() - t0
            out.chunks += 1
            ids = list(msg.get("output_ids") or [])
            out.output_ids = out.output_ids + ids if incremental else ids
            last = msg
            if req.abort == "mid_stream" and out.chunks >= req.abort_after:
                _hard_close(conn, sock)
                out.status = "aborted"
                return out
            if req.abort == "endpoint" and not abort_sent and out.chunks >= req.abort_after:
                abort_sent = _abort_endpoint(host, port, rid, out)
        out.latency_s = time.perf_counter() - t0
        out.finish = _finish_type((last or {}).get("meta_info"))
        if req.abort == "endpoint":
            _finish_endpoint_abort(out, last, done, req.max_new_tokens)
        else:  # mid_stream here: the stream ended before its k-th chunk (chunks coalesced)
            out.abort_late = req.abort is not None
            _validate(out, last, done, req.max_new_tokens)
        return out
    except (OSError, ValueError, http.client.HTTPException) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    finally:
        out.latency_s = out.latency_s or (time.perf_counter() - t0)
        conn.close()


def _abort_endpoint(host: str, port: int, rid: str, out: Outcome) -> bool:
    """POST /abort_request for ``rid``; a failure is the outcome's error. Returns True (sent)."""
    try:
        status, body = http_call(host, port, "POST", "/abort_request", {"rid": rid}, timeout=30)
    except (OSError, http.client.HTTPException) as e:
        status, body = None, str(e).encode()
    if status != 200:
        out.error = f"/abort_request -> {status}: {body[:200]!r}"
    return True


def _finish_endpoint_abort(out: Outcome, last: Optional[Dict[str, Any]], done: bool,
                           max_new: int) -> None:
    """An endpoint-aborted stream must end cleanly: with an abort finish reason, or complete
    when the abort came after the end (``abort_late``, counted as served)."""
    if out.error:  # /abort_request failed
        return
    if not done:
        out.error = "stream ended without [DONE] after /abort_request"
    elif out.finish == "abort":
        out.status = "aborted"
    else:
        out.abort_late = True
        _validate(out, last, done, max_new)


def _validate(out: Outcome, last: Optional[Dict[str, Any]], done: bool, max_new: int) -> None:
    meta = (last or {}).get("meta_info") or {}
    n = meta.get("completion_tokens")
    if not done:
        out.error = "stream ended without [DONE]"
    elif out.finish != "length":
        out.error = f"finish_reason {meta.get('finish_reason')!r}, expected length"
    elif len(out.output_ids) != max_new or (n is not None and n != max_new):
        out.error = f"{len(out.output_ids)} output ids (completion_tokens {n}), expected {max_new}"
    else:
        out.status = "served"


def generate_batch(host: str, port: int, prompts: Sequence[Sequence[int]], max_new: int,
                   timeout: float = 180.0) -> List[Optional[List[int]]]:
    """One batched, non-streamed ``/generate`` (input order kept); None where none came back."""
    if not prompts:
        return []
    body = {"input_ids": [list(p) for p in prompts],
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    status, data = http_call(host, port, "POST", "/generate", body, timeout=timeout)
    if status != 200:
        raise RuntimeError(f"/generate batch -> HTTP {status}: {data[:300]!r}")
    res = json.loads(data)
    res = res if isinstance(res, list) else [res]
    return [list(r.get("output_ids") or []) if isinstance(r, dict) else None for r in res]


EDGE_CASES = ("empty_prompt", "prompt_longer_than_context", "huge_max_new_tokens")


def context_tokens(model: str) -> int:
    """The model's context (``max_position_embeddings`` of its config)."""
    return int(json.loads(model_config_path(model).read_text())["max_position_embeddings"])


def _edge_request(host: str, port: int, case: str, context: int) -> Dict[str, Any]:
    """One edge-input request; returns what the server did (status, error or outputs)."""
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    ids = {"empty_prompt": [], "prompt_longer_than_context": [7] * (context + 16)}.get(case, [11] * 64)
    if case != "huge_max_new_tokens":
        try:
            status, data = http_call(host, port, "POST", "/generate", {"input_ids": ids, "sampling_params": params},
                                     timeout=120)
        except (OSError, http.client.HTTPException) as e:
            return dict(http_status=None, error=f"{type(e).__name__}: {e}"[:200])
        try:
            body = json.loads(data)
        except ValueError:
            body = None
        rec: Dict[str, Any] = dict(http_status=status)
        if status != 200 or not isinstance(body, dict) or "output_ids" not in body:
            rec["error"] = data[:200].decode(errors="replace")
        else:
            rec["output_ids"] = list(body.get("output_ids") or [])
            rec["finish"] = _finish_type(body.get("meta_info"))
        return rec
    # 10^9 new tokens: accepted or refused up front? If accepted, abort it after the first chunk.
    rid = f"edge-{case}-{port}"
    payload = {"input_ids": ids, "rid": rid, "stream": True,
               "sampling_params": dict(params, max_new_tokens=10**9)}
    conn = http.client.HTTPConnection(host, port, timeout=120)
    try:
        conn.request("POST", "/generate", body=json.dumps(payload).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        rec = dict(http_status=resp.status)
        if resp.status != 200:
            rec["error"] = resp.read()[:200].decode(errors="replace")
            return rec
        rec["first_chunk"], aborted = False, False
        for raw in iter(resp.readline, b""):
            line = raw.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            msg = json.loads(line[5:].strip())
            if "error" in msg:
                rec["error"] = json.dumps(msg["error"])[:200]
                break
            if not aborted:
                rec["first_chunk"] = True
                http_call(host, port, "POST", "/abort_request", {"rid": rid}, timeout=30)
                aborted = True
            if _finish_type(msg.get("meta_info")):
                rec["finish"] = _finish_type(msg.get("meta_info"))
        return rec
    except (OSError, ValueError, http.client.HTTPException) as e:
        return dict(http_status=None, error=f"{type(e).__name__}: {e}"[:200])
    finally:
        conn.close()


def edge_inputs(server: "Server", context: int) -> Dict[str, Dict[str, Any]]:
    """Every EDGE_CASES request against ``server`` (``context``: the model's context length),
    then whether it is still healthy."""
    out = {case: _edge_request(server.host, server.port, case, context) for case in EDGE_CASES}
    out["_health_after"] = dict(alive=server.alive(), health=server.status("/health"))
    return out
