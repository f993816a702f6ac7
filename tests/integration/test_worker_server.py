"""`WorkerConfig` validation, the worker command line, and `WorkerServer` in this process.

The Ray actor runs `WorkerServer` in-process (no subprocess), so its start/stop lifecycle is
tested here directly: start returns a bound address that answers health and RPCs, stop ends
in-flight streams with UNAVAILABLE once its grace is over and leaves every block free.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
from pydantic import ValidationError

from model_runtime.engine import EngineConfig
from proto.pdserve.v1 import inference_pb2, worker_pb2_grpc
from proto.pdserve.v1 import worker_pb2 as pb
from worker.cli import parse_args
from worker.config import WorkerConfig
from worker.step_gate import hold, release
from worker_main import server as worker_server

OPTS = [("grpc.enable_http_proxy", 0)]


def test_config_validation(tmp_path: Path) -> None:
    cfg = WorkerConfig(model_dir=tmp_path, role="decode")
    assert cfg.worker_id.startswith("worker-") and cfg.port == 0 and cfg.host == "127.0.0.1"
    assert WorkerConfig.model_validate_json(cfg.model_dump_json()) == cfg
    for bad in (
        {"worker_id": "a/b"},
        {"worker_id": "a@b"},
        {"role": "router"},
        {"port": 70000},
        {"torch_threads": 0},
        {"transfer_timeout_s": 0},
        {"surprise": 1},
    ):
        with pytest.raises(ValidationError):
            WorkerConfig(**{"model_dir": tmp_path, "role": "decode", **bad})
    with pytest.raises(ValidationError):
        cfg.model_copy(update={}).__setattr__("port", 1)  # frozen


def test_command_line(tmp_path: Path) -> None:
    engine = EngineConfig(block_size=8, num_kv_blocks=32)
    cfg, secret = parse_args(
        ["--model", str(tmp_path), "--role", "prefill", "--worker-id", "p7", "--port", "0"]
        + ["--engine-json", engine.model_dump_json(), "--torch-threads", "1"]
        + ["--kv-host", "127.0.0.1", "--transfer-timeout-s", "5", "--stop-grace-s", "2"]
    )
    assert (cfg.worker_id, cfg.role, cfg.engine, cfg.torch_threads) == ("p7", "prefill", engine, 1)
    assert (cfg.transfer_timeout_s, cfg.stop_grace_s, secret) == (5.0, 2.0, None)
    with pytest.raises(ValidationError):
        parse_args(["--model", str(tmp_path), "--role", "decode", "--engine-json", '{"x": 1}'])


def test_server_lifecycle_in_process(tiny_model_dir: Path, hold_dir: Path) -> None:
    """... and a stop cuts a request still running: the worker holds after its first steps
    (`worker.step_gate`), so the request is there when the stop comes, on any machine."""
    cfg = WorkerConfig(
        worker_id="inproc",
        model_dir=tiny_model_dir,
        role="colocated",
        engine=EngineConfig(block_size=8, num_kv_blocks=160),
    )
    server = worker_server(cfg)
    address = server.start()
    try:
        with grpc.insecure_channel(address, OPTS) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            status = stub.GetStatus(pb.GetStatusRequest(), timeout=5)
            assert (status.worker_id, status.role) == ("inproc", "colocated")
            assert status.total_blocks == status.free_blocks == 160
            assert status.kv_endpoint == server.kv_endpoint and status.epoch == server.epoch
            assert status.engine_steps == 0 and status.engine_step_wall_s == 0.0
            short = pb.WorkerGenerateRequest(
                request_id="short",
                prompt_token_ids=[4, 5],
                sampling=pb.WorkerSampling(max_tokens=3),
            )
            assert sum(len(c.token_ids) for c in stub.Generate(short, timeout=30)) == 3
            deadline = time.monotonic() + 5  # the snapshot is republished after the iteration
            while (status := stub.GetStatus(pb.GetStatusRequest(), timeout=5)).engine_steps < 3:
                assert time.monotonic() < deadline, status
                time.sleep(0.01)
            assert status.engine_steps == 3  # one prefill step (first token), two decode steps
            assert status.engine_step_wall_s > 0 and status.engine_step_cpu_s > 0
            req = pb.WorkerGenerateRequest(
                request_id="long",
                prompt_token_ids=[4, 5, 6],
                sampling=pb.WorkerSampling(max_tokens=64),
            )
            hold(hold_dir, "inproc", until_steps=status.engine_steps + 2)
            call = stub.Generate(req, timeout=30)
            next(call)
            stopper = threading.Thread(target=server.stop, args=(0.1,))
            stopper.start()
            with pytest.raises(grpc.RpcError) as info:
                list(call)
            stopper.join(30)
            assert isinstance(info.value, grpc.Call)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    finally:
        server.stop(0.0)
        release(hold_dir, "inproc")
    assert server.address == address


def test_stop_ends_the_grammar_compile_thread(tiny_model_dir: Path) -> None:
    """A constrained request has its grammar compiled on the service's compile thread; the
    stop ends that thread. The test keeps the service alive, as a reference cycle does until
    the collector happens to run (freeing the service would end the thread too; the stop must
    not rely on that)."""
    cfg = WorkerConfig(
        worker_id="grammar-stop",
        model_dir=tiny_model_dir,
        role="colocated",
        engine=EngineConfig(block_size=8, num_kv_blocks=64),
    )
    before = set(threading.enumerate())
    server = worker_server(cfg)
    server.start()
    try:
        with grpc.insecure_channel(server.address, OPTS) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            choice = inference_pb2.ChoiceList(choices=["yes", "no"])
            req = pb.WorkerGenerateRequest(
                request_id="constrained",
                prompt_token_ids=[4, 5],
                sampling=pb.WorkerSampling(
                    max_tokens=8, structured_outputs=inference_pb2.StructuredOutputs(choice=choice)
                ),
            )
            chunks = list(stub.Generate(req, timeout=30))
            assert chunks[-1].finished, chunks
        compilers = [
            t for t in threading.enumerate() if t not in before and t.name.startswith("grammar")
        ]
        assert compilers, [t.name for t in threading.enumerate()]
        service = server._service
        assert service is not None
    finally:
        server.stop(0.0)
    for thread in compilers:
        thread.join(10)
        assert not thread.is_alive(), thread.name
    del service
