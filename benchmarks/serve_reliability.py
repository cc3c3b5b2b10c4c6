"""Reliability load test: many concurrent streams against a live server, some of them hostile.

Starts `python -m serve` as a subprocess on 127.0.0.1 (a tiny random model with a trained
byte-level BPE tokenizer is built when no --model-dir is given), with an API key, a small body
limit and a KV pool sized for about `--pool-seqs` concurrent sequences, then fires `--requests`
streaming requests at once. A fraction `--hostile` of them are hostile, drawn at random from
issue 20's table and its neighbours (top_k/seed overflow, NaN fields, a lone surrogate, a
text/plain body, a body over the limit, a missing API key, a huge prompt just under the limit,
a client that disconnects mid-stream). Every other request is well formed and greedy.

Checked and reported: every well-formed request completes with exactly the text the same
prompt produces alone in an offline engine, no well-formed request gets a 5xx, every hostile
one gets its 4xx (or, for disconnects, is aborted), 0 KV blocks are held once the server is
idle, and /health's worst latency while all this runs. Prints a table; writes
benchmarks/results/serve_reliability-<time>.json. Exit status 1 if any check fails.

    .venv/bin/python -m benchmarks.serve_reliability                  # 200 streams, 10% hostile
    .venv/bin/python -m benchmarks.serve_reliability --requests 40    # a quick pass
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
from warsha.cli import quiet_environment  # noqa: E402

quiet_environment()  # offline (the server child inherits it), no every-run library warnings

import httpx  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
API_KEY = "reliability-key"
AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
HOSTILE_KINDS = (
    "top_k_overflow",
    "seed_overflow_stream",
    "nan_temperature",
    "nan_repetition_penalty",
    "lone_surrogate",
    "text_plain",
    "body_over_limit",
    "no_api_key",
    "huge_prompt_under_limit",
    "disconnect_mid_stream",
)
EXPECTED_STATUS = {
    "top_k_overflow": 400,
    "seed_overflow_stream": 400,
    "nan_temperature": 400,
    "nan_repetition_penalty": 400,
    "lone_surrogate": 400,
    "text_plain": 415,
    "body_over_limit": 413,
    "no_api_key": 401,
    "huge_prompt_under_limit": 400,
    "disconnect_mid_stream": 200,
}


def build_model(path: Path) -> Path:
    """A tiny random Llama with a trained tokenizer (the test fixtures' builder)."""
    from warsha.random_models import make_model

    if not (path / "config.json").is_file():
        make_model(path, seed=5, max_position_embeddings=256)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, port: int, num_blocks: int, max_bytes: int) -> subprocess.Popen:
    """`python -m serve` on 127.0.0.1:port; returns once /health answers."""
    cmd = [sys.executable, "-m", "serve", str(model), "--port", str(port), "--dtype", "float32"]
    cmd += ["--num-kv-blocks", str(num_blocks), "--max-request-bytes", str(max_bytes), "--api-key", API_KEY]
    cmd += ["--max-model-len", "256", "--log-level", "warning", "--threads", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start within 300 s")


def references(model: Path, prompts: list[str], max_tokens: int) -> list[str]:
    """Each prompt's greedy text, generated alone (one request at a time) by an offline engine."""
    from serve import LLM, SamplingParams

    llm = LLM(model, dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [llm.generate(p, params)[0].text for p in prompts]


def hostile_request(kind: str, max_bytes: int) -> tuple[dict[str, str], bytes, bool]:
    """(headers, body, stream) for one hostile kind."""
    base: dict[str, Any] = {"prompt": "the quick", "max_tokens": 8, "stream": True}
    headers, raw = dict(AUTH), None
    if kind == "top_k_overflow":
        base["top_k"] = 2**63
    elif kind == "seed_overflow_stream":
        base.update(seed=2**64, top_k=2**63)
    elif kind == "nan_temperature":
        raw = json.dumps(base)[:-1] + ', "temperature": NaN}'
    elif kind == "nan_repetition_penalty":
        raw = json.dumps(base)[:-1] + ', "repetition_penalty": NaN}'
    elif kind == "lone_surrogate":
        raw = '{"prompt": "a\\ud800b", "max_tokens": 4, "stream": true}'
    elif kind == "text_plain":
        headers["Content-Type"] = "text/plain"
    elif kind == "body_over_limit":
        base["prompt"] = "x" * (max_bytes + 1000)
    elif kind == "no_api_key":
        del headers["Authorization"]
    elif kind == "huge_prompt_under_limit":
        base["prompt"] = "the quick brown fox " * ((max_bytes - 200) // 20)
    elif kind == "disconnect_mid_stream":
        base.update(max_tokens=200, ignore_eos=True, temperature=0)
    body = (raw if raw is not None else json.dumps(base)).encode()
    return headers, body, True


async def well_formed(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One greedy stream; its status, text and token count."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    text, tokens, errors = [], None, []
    async with client.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "text": None, "error": (await r.aread()).decode()[:300]}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event["error"])
            for choice in event.get("choices", []):
                text.append(choice.get("text", ""))
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return {"status": 500 if errors else 200, "text": "".join(text), "tokens": tokens, "error": errors or None}


async def hostile(client: httpx.AsyncClient, kind: str, max_bytes: int) -> dict[str, Any]:
    headers, body, _ = hostile_request(kind, max_bytes)
    async with client.stream("POST", "/v1/completions", content=body, headers=headers) as r:
        if kind == "disconnect_mid_stream" and r.status_code == 200:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break  # leaving the block closes the connection mid-stream
            return {"status": r.status_code, "kind": kind}
        await r.aread()
        return {"status": r.status_code, "kind": kind}


async def watch_health(url: str, stop: asyncio.Event) -> list[float]:
    """/health latencies (seconds; -1 for a failed probe), sampled every 50 ms until `stop`."""
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        while not stop.is_set():
            t = time.perf_counter()
            try:
                ok = (await client.get("/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            out.append(time.perf_counter() - t if ok else -1.0)
            await asyncio.sleep(0.05)
    return out


async def storm(url: str, jobs: list[tuple[str, Any]], max_tokens: int, max_bytes: int) -> tuple[list, list[float]]:
    stop = asyncio.Event()
    health = asyncio.ensure_future(watch_health(url, stop))
    limits = httpx.Limits(max_connections=len(jobs) + 10, max_keepalive_connections=len(jobs) + 10)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        tasks = [
            well_formed(client, arg, max_tokens) if kind == "ok" else hostile(client, arg, max_bytes)
            for kind, arg in jobs
        ]
        results = await asyncio.gather(*tasks, return_exceptions=True)
    stop.set()
    return list(results), await health


def wait_idle(url: str, timeout: float = 60) -> dict[str, float]:
    """Metrics once nothing runs or waits (the block count is read then)."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=10).text
        m = {
            line.split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("warsha_") and "{" in line and "finished_reason" not in line and "_bucket" not in line
        }
        if m["warsha_num_requests_running"] == 0 and m["warsha_num_requests_waiting"] == 0:
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    workdir = Path(args.model_dir or Path(tempfile.gettempdir()) / "warsha-reliability-model")
    model = workdir if args.model_dir else build_model(workdir)
    words = "the quick brown fox jumps over lazy dog serving engines batch many requests paged attention".split()
    n_hostile = round(args.requests * args.hostile)
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(2, 8))) for _ in range(args.requests - n_hostile)]
    kinds = [HOSTILE_KINDS[i % len(HOSTILE_KINDS)] for i in range(n_hostile)]
    rng.shuffle(kinds)
    jobs: list[tuple[str, Any]] = [("ok", p) for p in prompts] + [("hostile", k) for k in kinds]
    rng.shuffle(jobs)
    t0 = time.perf_counter()
    refs = dict(zip(prompts, references(model, prompts, args.max_tokens)))
    ref_seconds = time.perf_counter() - t0
    per_seq_blocks = -(-(12 + args.max_tokens) // 16)
    num_blocks = args.pool_seqs * per_seq_blocks
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(model, port, num_blocks, args.max_request_bytes)
    try:
        t0 = time.perf_counter()
        results, health = asyncio.run(storm(url, jobs, args.max_tokens, args.max_request_bytes))
        storm_seconds = time.perf_counter() - t0
        metrics = wait_idle(url)
        alive = httpx.get(f"{url}/health", timeout=10).status_code
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    ok_total = ok_identical = ok_5xx = ok_other = 0
    mismatches, hostile_bad = [], []
    hostile_by_kind: dict[str, dict[int, int]] = {}
    for (kind, arg), res in zip(jobs, results):
        if isinstance(res, BaseException):
            res = {"status": -1, "error": repr(res)}
        if kind == "ok":
            ok_total += 1
            if res["status"] >= 500 or res["status"] < 0:
                ok_5xx += 1
            elif res["status"] != 200:
                ok_other += 1
            elif res["text"] == refs[arg] and res["tokens"] == args.max_tokens:
                ok_identical += 1
            else:
                mismatches.append({"prompt": arg, "got": res["text"], "want": refs[arg]})
            continue
        hostile_by_kind.setdefault(arg, {})
        hostile_by_kind[arg][res["status"]] = hostile_by_kind[arg].get(res["status"], 0) + 1
        if res["status"] != EXPECTED_STATUS[arg]:
            hostile_bad.append({"kind": arg, "status": res["status"], "error": res.get("error")})
    leaked = int(metrics["warsha_kv_cache_blocks"] - metrics["warsha_kv_cache_free_blocks"])
    health_failed = sum(1 for h in health if h < 0)
    health_sorted = sorted(h for h in health if h >= 0) or [0.0]
    return {
        "requests": args.requests,
        "hostile": n_hostile,
        "well_formed": ok_total,
        "well_formed_identical": ok_identical,
        "well_formed_5xx": ok_5xx,
        "well_formed_other_status": ok_other,
        "mismatches": mismatches[:5],
        "hostile_by_kind": hostile_by_kind,
        "hostile_unexpected": hostile_bad,
        "kv_blocks": num_blocks,
        "kv_blocks_leaked": leaked,
        "max_tokens": args.max_tokens,
        "max_request_bytes": args.max_request_bytes,
        "health_probes": len(health),
        "health_failed": health_failed,
        "health_p50_ms": 1000 * health_sorted[len(health_sorted) // 2],
        "health_max_ms": 1000 * health_sorted[-1],
        "health_after": alive,
        "storm_seconds": storm_seconds,
        "reference_seconds": ref_seconds,
        "load_average": os.getloadavg(),
        "passed": ok_identical == ok_total
        and ok_5xx == 0
        and leaked == 0
        and not hostile_bad
        and alive == 200
        and health_failed == 0,
    }


def print_report(r: dict[str, Any]) -> None:
    rows = [
        ("requests (concurrent streams)", r["requests"]),
        ("  hostile", r["hostile"]),
        ("  well-formed", r["well_formed"]),
        ("well-formed identical to alone", r["well_formed_identical"]),
        ("well-formed 5xx", r["well_formed_5xx"]),
        ("well-formed other non-200", r["well_formed_other_status"]),
        ("hostile with unexpected status", len(r["hostile_unexpected"])),
        ("KV blocks in pool", r["kv_blocks"]),
        ("KV blocks leaked when idle", r["kv_blocks_leaked"]),
        ("/health probes (failed)", f"{r['health_probes']} ({r['health_failed']})"),
        ("/health p50 / max (ms)", f"{r['health_p50_ms']:.1f} / {r['health_max_ms']:.1f}"),
        ("storm wall time (s)", f"{r['storm_seconds']:.1f}"),
        ("load average (1/5/15 min)", " ".join(f"{x:.1f}" for x in r["load_average"])),
        ("PASSED", r["passed"]),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("hostile answers by kind:", json.dumps(r["hostile_by_kind"], sort_keys=True))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=200, help="concurrent streaming requests (default: %(default)s)")
    p.add_argument("--hostile", type=float, default=0.1, help="fraction that is hostile (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per well-formed request (default: %(default)s)")
    p.add_argument("--pool-seqs", type=int, default=20, help="KV pool size in sequences (default: %(default)s)")
    p.add_argument("--max-request-bytes", type=int, default=256 * 1024, help="server body limit (default: %(default)s)")
    p.add_argument("--model-dir", type=Path, default=None, help="serve this model instead of a tiny random one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-save", action="store_true", help="do not write benchmarks/results/")
    args = p.parse_args(argv)
    result = run(args)
    print_report(result)
    if not args.no_save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        out = RESULTS / f"serve_reliability-{time.strftime('%Y%m%d-%H%M%S')}.json"
        out.write_text(json.dumps(result, indent=2))
        print(f"wrote {out}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
