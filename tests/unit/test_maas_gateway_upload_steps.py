"""The named steps of the boot-resource upload, each on its own: the decisions the poll loop relies on."""

import hashlib
import json
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gpuaas_maas_gateway.adapters.maas_errors import MaasError, MaasUnreachable
from gpuaas_maas_gateway.service_layer import upload_image
from gpuaas_maas_gateway.service_layer.shared import Unresolvable, now

POLL_S, GRACE_S = 1.0, 5.0


class FakeOps:
    def __init__(self) -> None:
        self.settings = SimpleNamespace(maas_poll_interval_s=POLL_S, maas_grace_s=GRACE_S, maas_upload_chunk_bytes=4)
        self.sets: list[dict[str, Any]] = []
        self.finished: list[tuple[str, dict[str, Any]]] = []

    async def set(self, op_id: str, *, delay: float, **fields: Any) -> None:
        self.sets.append({"op_id": op_id, "delay": delay, **fields})

    async def finish(self, row: Any, status: str, **kw: Any) -> None:
        self.finished.append((status, kw))

    def retry_delay(self, exc: MaasError | None = None) -> float:
        return POLL_S if exc is None or exc.retry_after is None else max(POLL_S, exc.retry_after)


def _row(**over: Any) -> dict[str, Any]:
    row = {
        "operation_id": "op-1",
        "site": "default",
        "state": "pending",
        "unknown_since": None,
        "maas_calls": 0,
        "params": json.dumps({"name": "host-image", "source_path": "/nonexistent"}),
        "progress": None,
    }
    return {**row, **over}


def _upload(ops: FakeOps, **row: Any) -> Any:
    progress = {"sha256": "ab" * 32, "size": 8}
    return upload_image._Upload(ops, None, _row(**row), {}, progress, "host-image", "amd64/generic", "/nonexistent")


@pytest.mark.parametrize(
    "state, unknown_for, may_show",
    [
        ("unknown", None, True),  # unknown since an unrecorded moment: give it the grace period
        ("unknown", 1.0, True),
        ("unknown", 10.0, False),
        ("pending", None, False),
        ("submitting", 10.0, False),
    ],
)
def test_a_lost_create_is_given_its_grace_period_before_it_is_sent_again(state, unknown_for, may_show):
    since = now() - timedelta(seconds=unknown_for) if unknown_for is not None else None
    upload = _upload(FakeOps(), state=state, unknown_since=since)
    assert upload_image._lost_create_may_still_show(upload) is may_show


async def test_the_file_is_hashed_once_and_its_digest_kept_in_the_progress(tmp_path: Path) -> None:
    image = tmp_path / "image.tgz"
    image.write_bytes(b"0123456789")
    ops = FakeOps()
    row = _row(params=json.dumps({"name": "host-image", "source_path": str(image)}))
    upload = await upload_image._hashed(ops, None, row)
    assert (upload.digest, upload.size, upload.path) == (hashlib.sha256(b"0123456789").hexdigest(), 10, str(image))
    assert json.loads(ops.sets[0]["progress"]) == {"sha256": upload.digest, "size": 10}

    again = await upload_image._hashed(ops, None, {**row, "progress": ops.sets[0]["progress"]})
    assert again.digest == upload.digest and len(ops.sets) == 1


async def test_a_file_that_is_not_the_one_asked_for_or_not_there_is_unresolvable(tmp_path: Path) -> None:
    image = tmp_path / "image.tgz"
    image.write_bytes(b"0123456789")
    wrong = json.dumps({"name": "host-image", "source_path": str(image), "sha256": "00" * 32})
    with pytest.raises(Unresolvable) as exc:
        await upload_image._hashed(FakeOps(), None, _row(params=wrong))
    assert exc.value.reason_code == "checksum_mismatch"
    with pytest.raises(Unresolvable) as exc:
        await upload_image._hashed(FakeOps(), None, _row())
    assert exc.value.reason_code == "source_unreadable"


@pytest.mark.parametrize("maas_calls, state", [(0, "pending"), (1, "unknown")])
async def test_unreachable_maas_is_tried_again_unknown_only_once_a_call_went_out(maas_calls, state) -> None:
    ops = FakeOps()
    await upload_image._after_maas_error(_upload(ops, maas_calls=maas_calls), MaasUnreachable(None, "refused"))
    assert ops.sets == [{"op_id": "op-1", "delay": POLL_S, "state": state, "last_error": ops.sets[0]["last_error"]}]
    assert not ops.finished


@pytest.mark.parametrize(
    "exc", [MaasError(502, "bad gateway", outcome_unknown=True), MaasError(503, "busy", retry_after=3.0)]
)
async def test_a_lost_answer_or_a_busy_maas_is_polled(exc) -> None:
    ops = FakeOps()
    await upload_image._after_maas_error(_upload(ops, maas_calls=1), exc)
    (written,) = ops.sets
    assert written["state"] == "unknown" and written["resolution"] == "polled"
    assert written["unknown_since"] is not None and written["delay"] == ops.retry_delay(exc)
    assert not ops.finished


@pytest.mark.parametrize(
    "status, body, reason", [(400, "SHA256 does not match", "checksum_mismatch"), (403, "no", "maas_http_403")]
)
async def test_a_definite_refusal_fails_the_upload_with_its_reason(status, body, reason) -> None:
    ops = FakeOps()
    await upload_image._after_maas_error(_upload(ops, maas_calls=1), MaasError(status, body))
    assert ops.finished == [("failed", {"reason_code": reason, "message": body})]
    assert not ops.sets
