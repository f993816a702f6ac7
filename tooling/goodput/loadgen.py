"""The load generator: sends a run's requests at their scheduled times over the public API.

Runs in its own process (`python -m tooling.goodput.loadgen JOB.json RESULT.json`), started
by the orchestrator with `run_load_process` / `run_load_process_async`, so the orchestrator's
work (starting clusters, plotting) never delays a send. It imports no torch.

`run_load(job)` (async, one event loop):

1. builds every prompt's token ids (random ids, or windows of real text when the job carries a
   `corpus`) and `GenerateRequest` before the clock starts (token ids,
   `max_tokens = output_len`, `ignore_eos`, greedy), and opens `job.channels` gRPC channels
   (separate connections; requests go round-robin) — or, for a job with `api="openai"`, one
   HTTP session to an OpenAI-compatible server (`openai_load`: streaming `/v1/completions`
   with the same token ids and lengths);
2. a dispatcher sleeps until just before each request's scheduled time (then yields to the
   loop until the time), calls `Generate` and records the moment it did: the difference is
   the request's *send lag*; one task per request consumes its stream, timestamping every
   message on the client's clock. The process asks for a higher CPU priority than the servers
   (`raise_priority`; what it got is stored in the result's meta as `loadgen_priority`);
3. when every stream has ended it returns a `RunResult`. Every request ends: the job's
   `timeout_s` is each call's gRPC deadline, and a failed call is recorded with its status name.

A run whose p99 send lag exceeds `records.SEND_LAG_LIMIT_MS` is marked invalid by `RunResult`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
from tqdm import tqdm

from proto.pdserve.v1 import inference_pb2, inference_pb2_grpc
from security.channels import ClientSecurity
from tooling.cpu import self_cpu_s
from tooling.goodput.openai_load import completion_body, consume_openai
from tooling.goodput.records import TIMING_FIELDS, RequestRecord, RequestSpec, RunResult
from tooling.goodput.traces import prompt_tokens

REPO_ROOT = Path(__file__).resolve().parents[2]
CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0), ("grpc.use_local_subchannel_pool", 1)]
START_LEAD_S = 0.05  # t = 0 is this far after the dispatcher starts, so request 0 is on time
EARLY_WAKE_S = 0.002  # the dispatcher wakes this early, then yields to the loop until the time
FIFO_PRIORITY = 10  # see `raise_priority`
NICE = -10


@dataclass
class LoadJob:
    """Everything one run needs; JSON-serialisable so it can cross the process boundary.
    `vocab_size` None = ask the router (GetModelInfo; an OpenAI job must give it). `label`
    names request ids and the progress bar. `corpus` None = random-id prompts; else the
    token stream real-text prompts are cut from (`traces.prompt_tokens`)."""

    address: str
    specs: list[RequestSpec]
    config: str = ""
    rate: float = 0.0
    arrival: str = "poisson"
    seed: int = 0
    token_seed: int = 0
    timeout_s: float = 120.0
    vocab_size: int | None = None
    channels: int = 4
    label: str = "run"
    api: str = "grpc"  # "grpc": pdserve's Generate at `address`; "openai": `address` is a /v1 URL
    model: str = ""  # the OpenAI model name (api "openai")
    meta: dict[str, Any] = field(default_factory=dict)
    corpus: list[int] | None = None
    # How to reach `address` (`security.channels.ClientSecurity.to_json`: paths, no token).
    security: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LoadJob:
        specs = [RequestSpec(**s) for s in data["specs"]]
        return cls(**{**data, "specs": specs})


async def model_info(
    address: str, timeout_s: float = 10.0, security: ClientSecurity | None = None
) -> inference_pb2.ModelInfo:
    """The router's `GetModelInfo` answer (raises grpc.aio.AioRpcError)."""
    async with (security or ClientSecurity()).aio_channel(address, CHANNEL_OPTIONS) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)  # type: ignore[no-untyped-call]
        info: inference_pb2.ModelInfo = await stub.GetModelInfo(
            inference_pb2.GetModelInfoRequest(), timeout=timeout_s
        )
        return info


def build_requests(job: LoadJob, vocab_size: int) -> list[inference_pb2.GenerateRequest]:
    """One `GenerateRequest` per spec: exact token ids, exact output length, greedy."""
    out = []
    prompts = prompt_tokens(job.specs, vocab_size, job.token_seed, job.corpus)
    for spec, ids in zip(job.specs, prompts, strict=True):
        sampling = inference_pb2.SamplingParams(
            max_tokens=spec.output_len, temperature=0.0, ignore_eos=True
        )
        req = inference_pb2.GenerateRequest(
            request_id=f"{job.label}-{job.token_seed}-{spec.index}", sampling=sampling
        )
        req.token_ids.ids.extend(ids)
        out.append(req)
    return out


async def consume_stream(
    call: Any, rec: RequestRecord, t_sent: float, loop: asyncio.AbstractEventLoop
) -> None:
    """Read one Generate stream into `rec`: tokens, inter-token gaps, TTFT/TPOT/e2e (client
    clock, relative to `t_sent`), the final's usage, server timings and workers; a gRPC error
    becomes `rec.status`/`rec.error`, a short OK stream INCOMPLETE. Shared by every load
    generator (goodput bench, ratio harness)."""
    first = last = prev = None
    try:
        async for resp in call:
            now = loop.time()
            last = now
            if resp.token_ids:
                if first is None:
                    first = now
                else:
                    rec.itl_ms.append((now - prev) * 1e3)  # type: ignore[operator]
                prev = now
                rec.num_tokens += len(resp.token_ids)
            if resp.HasField("final"):
                f = resp.final
                rec.finish_reason = f.finish_reason
                rec.cached_tokens = f.usage.cached_tokens
                t = f.timings
                rec.server = {"ttft_ms": t.ttft_ms, "e2e_ms": t.e2e_ms}
                rec.server |= {name: getattr(t, name) for name in TIMING_FIELDS}
                rec.prefill_worker, rec.decode_worker = f.prefill_worker, f.decode_worker
                rec.prefill_path = f.prefill_path
    except grpc.aio.AioRpcError as exc:
        rec.status, rec.error = exc.code().name, exc.details() or ""
    rec.close(t_sent, first, prev, last if last is not None else loop.time())


Send = Callable[[int, int, RequestRecord, float, asyncio.AbstractEventLoop], Awaitable[None]]
"""`send(k, i, record, t_sent, loop)`: start request `i` (the k-th sent) now; the awaitable
reads its answer into `record`."""


@contextlib.asynccontextmanager
async def _grpc_sender(job: LoadJob) -> AsyncIterator[Send]:
    """Requests built, `job.channels` channels opened (with `job.security`) and warmed; closed
    on exit."""
    security = ClientSecurity.from_json(job.security)
    vocab = job.vocab_size or (await model_info(job.address, security=security)).vocab_size
    requests = build_requests(job, vocab)
    channels = [
        security.aio_channel(job.address, CHANNEL_OPTIONS) for _ in range(max(1, job.channels))
    ]
    try:
        stubs = [inference_pb2_grpc.InferenceStub(ch) for ch in channels]  # type: ignore[no-untyped-call]
        for stub in stubs:  # connect and warm every channel's call path before the clock runs
            await stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=10.0)

        def send(
            k: int, i: int, rec: RequestRecord, t_sent: float, loop: asyncio.AbstractEventLoop
        ) -> Awaitable[None]:
            rec.request_id = requests[i].request_id
            call = stubs[k % len(stubs)].Generate(requests[i], timeout=job.timeout_s)
            return consume_stream(call, rec, t_sent, loop)

        yield send
    finally:
        for ch in channels:
            await ch.close()


@contextlib.asynccontextmanager
async def _openai_sender(job: LoadJob) -> AsyncIterator[Send]:
    """Prompts built, one aiohttp session (unlimited connections) warmed; closed on exit."""
    if job.vocab_size is None:
        raise ValueError("an OpenAI job needs vocab_size (its prompts are token ids)")
    prompts = prompt_tokens(job.specs, job.vocab_size, job.token_seed, job.corpus)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        async with session.get(f"{job.address}/models") as r:  # connect before the clock runs
            r.raise_for_status()

        def send(
            k: int, i: int, rec: RequestRecord, t_sent: float, loop: asyncio.AbstractEventLoop
        ) -> Awaitable[None]:
            rec.request_id = f"{job.label}-{job.token_seed}-{job.specs[i].index}"
            body = completion_body(job.model, prompts[i], job.specs[i].output_len)
            return consume_openai(session, job.address, body, rec, t_sent, loop, job.timeout_s)

        yield send


async def run_load(job: LoadJob, progress: bool | None = None) -> RunResult:
    """Send `job.specs` at their times to `job.address`; return every request's record.
    `progress` None = a progress bar only when stderr is a terminal."""
    if not job.specs:
        raise ValueError("the job has no requests")
    sender = _openai_sender(job) if job.api == "openai" else _grpc_sender(job)
    async with sender as send:
        show = sys.stderr.isatty() if progress is None else progress
        bar = tqdm(total=len(job.specs), desc=job.label, leave=False, disable=not show, unit="req")
        loop = asyncio.get_running_loop()
        gc.collect()
        gc.disable()  # a collection pause inside the dispatch loop would show as send lag
        try:
            t0 = loop.time() + START_LEAD_S
            tasks = []
            records = []
            order = sorted(range(len(job.specs)), key=lambda i: job.specs[i].arrival_s)
            for k, i in enumerate(order):
                spec = job.specs[i]
                target = t0 + spec.arrival_s
                if target - loop.time() > EARLY_WAKE_S:
                    await asyncio.sleep(target - loop.time() - EARLY_WAKE_S)
                while loop.time() < target:  # a late wake-up (busy CPUs) still sends on time
                    await asyncio.sleep(0)
                t_sent = loop.time()
                rec = RequestRecord(
                    index=spec.index,
                    request_id="",
                    scheduled_s=spec.arrival_s,
                    sent_s=t_sent - t0,
                    input_len=spec.input_len,
                    output_len=spec.output_len,
                    prefix_group=spec.prefix_group,
                )
                records.append(rec)
                task = asyncio.ensure_future(send(k, i, rec, t_sent, loop))
                task.add_done_callback(lambda _t: bar.update(1))
                tasks.append(task)
            await asyncio.gather(*tasks)
            bar.close()
        finally:
            gc.enable()
    records.sort(key=lambda r: r.index)
    lags = np.array([r.send_lag_ms for r in records])
    return RunResult(
        config=job.config,
        rate=job.rate,
        arrival=job.arrival,
        seed=job.seed,
        token_seed=job.token_seed,
        records=records,
        duration_s=max(r.end_s for r in records),
        send_lag_p50_ms=float(np.percentile(lags, 50)),
        send_lag_p99_ms=float(np.percentile(lags, 99)),
        meta=job.meta,
        t0_monotonic=t0,
    )


# ---------------------------------------------------------------------- the process boundary


def _argv(job_path: Path, out_path: Path) -> list[str]:
    return [sys.executable, "-m", "tooling.goodput.loadgen", str(job_path), str(out_path)]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def _files(job: LoadJob, workdir: Path | None) -> tuple[Path, Path]:
    folder = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="loadgen-"))
    folder.mkdir(parents=True, exist_ok=True)
    job_path, out_path = folder / f"{job.label}.job.json", folder / f"{job.label}.result.json"
    job_path.write_text(json.dumps(job.to_json()))
    out_path.unlink(missing_ok=True)
    return job_path, out_path


def _read(out_path: Path, rc: int) -> RunResult:
    if rc != 0 or not out_path.is_file():
        raise RuntimeError(f"load generator exited with status {rc} (see its stderr above)")
    return RunResult.from_json(json.loads(out_path.read_text()))


def run_load_process(job: LoadJob, workdir: Path | None = None) -> RunResult:
    """Run `job` in a fresh load-generator process and return its result (blocks). The job
    and result JSON files stay in `workdir` (a temp folder when None). RuntimeError if the
    process fails; its stderr (progress bar, traceback) goes to this process's stderr."""
    job_path, out_path = _files(job, workdir)
    proc = subprocess.run(_argv(job_path, out_path), env=_env(), stdin=subprocess.DEVNULL)
    return _read(out_path, proc.returncode)


async def run_load_process_async(job: LoadJob, workdir: Path | None = None) -> RunResult:
    """`run_load_process` without blocking the caller's event loop (e.g. a test that serves
    a fake cluster on that loop). Cancelling it kills the load-generator process."""
    job_path, out_path = _files(job, workdir)
    proc = await asyncio.create_subprocess_exec(
        *_argv(job_path, out_path), env=_env(), stdin=subprocess.DEVNULL
    )
    try:
        code = await proc.wait()
    except BaseException:  # cancelled or interrupted: the load must not go on without us
        if proc.returncode is None:
            proc.kill()
        raise
    return _read(out_path, code)


def raise_priority() -> str:
    """Ask the OS to run this process (and the threads it starts later) ahead of the servers:
    SCHED_FIFO where allowed (Linux, privileged), else a lower niceness, else nothing. Returns
    what it got. Why: on a machine whose cores the workers keep busy, a sleeping dispatcher
    can wake tens of ms late under the normal scheduler, which would make the server look
    slower than it is; the load generator sleeps almost all the time, so this costs the
    servers only the little CPU it would use anyway."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(FIFO_PRIORITY))
        return f"SCHED_FIFO {FIFO_PRIORITY}"
    except (AttributeError, PermissionError, OSError) as exc:
        fifo_error = f"SCHED_FIFO refused ({type(exc).__name__})"
    try:
        return f"nice {os.nice(NICE)}; {fifo_error}"
    except PermissionError:
        return f"nice {os.nice(0)} (lowering refused); {fifo_error}"


def main(argv: list[str] | None = None) -> int:
    """`python -m tooling.goodput.loadgen JOB.json RESULT.json` -> exit status 0/2."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m tooling.goodput.loadgen JOB.json RESULT.json", file=sys.stderr)
        return 2
    job = LoadJob.from_json(json.loads(Path(args[0]).read_text()))
    priority = raise_priority()
    result = asyncio.run(run_load(job))
    result.meta["loadgen_priority"] = priority
    result.meta["loadgen_cpu_s"] = self_cpu_s()
    Path(args[1]).write_text(json.dumps(result.to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
