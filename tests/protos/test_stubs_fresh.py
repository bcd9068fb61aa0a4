"""The committed stubs must equal what protoc generates from the .proto files now."""

from __future__ import annotations

from pathlib import Path

from protos.generate import ROOT, generate


def test_generated_stubs_are_fresh(tmp_path: Path):
    generate(tmp_path)
    fresh = sorted(p.relative_to(tmp_path) for p in (tmp_path / "protos").glob("*_pb2*.py*"))
    assert fresh, "protoc generated nothing"
    for rel in fresh:
        committed = ROOT / rel
        assert committed.exists(), f"{rel} is missing: run `python -m protos.generate`"
        assert committed.read_text() == (tmp_path / rel).read_text(), (
            f"{rel} is stale: run `python -m protos.generate` and commit the result")
    committed_stubs = sorted(p.relative_to(ROOT) for p in (ROOT / "protos").glob("*_pb2*.py*"))
    assert committed_stubs == fresh, "stubs without a .proto file are committed"


def test_stubs_import_and_services_exist():
    from protos import inference_pb2, inference_pb2_grpc, link_pb2_grpc, queue_pb2

    assert inference_pb2.DESCRIPTOR.package == "inflight.v1"
    assert hasattr(inference_pb2_grpc, "InferenceStub") and hasattr(link_pb2_grpc, "LinkStub")
    request = queue_pb2.QueuedRequest(request_id="r", prompt_token_ids=[1, 2, 3])
    assert queue_pb2.QueuedRequest.FromString(request.SerializeToString()) == request
