"""Bad input gives typed exceptions carrying the code and a message naming the field."""

import grpc
import numpy as np
import pytest

import logitserve
from conftest import H, H_REF, V


def _h(n=3, h=H):
    return np.ones((n, h), np.float32)


CASES = [
    # (exception, field named in the message, score kwargs)
    (logitserve.NotFound, "head", dict(head="nope", hidden=_h())),
    (logitserve.InvalidArgument, "hidden", dict(head="policy", hidden=_h(3, H + 1))),
    (logitserve.InvalidArgument, "target_ids", dict(head="policy", hidden=_h(), target_ids=[0, V, 1])),
    (logitserve.InvalidArgument, "target_ids", dict(head="policy", hidden=_h(), target_ids=[0, 1])),
    (logitserve.InvalidArgument, "temperature", dict(head="policy", hidden=_h(), temperature=0.0)),
    (logitserve.InvalidArgument, "reference_temperature",
     dict(head="policy", hidden=_h(), reference_head="reference", reference_hidden=_h(3, H_REF),
          forward_kl=True, reference_temperature=-1.0)),
    (logitserve.InvalidArgument, "jsd_beta",
     dict(head="policy", hidden=_h(), reference_head="reference", reference_hidden=_h(3, H_REF),
          jsd_beta=1.5)),
    (logitserve.InvalidArgument, "top_k", dict(head="policy", hidden=_h(), top_k=65)),
    (logitserve.InvalidArgument, "sequence_lengths",
     dict(head="policy", hidden=_h(), sequence_lengths=[1, 1])),
    (logitserve.InvalidArgument, "reference_hidden",
     dict(head="policy", hidden=_h(), forward_kl=True)),
    (logitserve.InvalidArgument, "logits",
     dict(logits=np.array([[0.0, np.nan], [0.0, 1.0]], np.float32))),
    (logitserve.FailedPrecondition, "head_version",
     dict(head="policy", hidden=_h(), head_version=999)),
]


@pytest.mark.parametrize("exc,field,kwargs", CASES, ids=[f"{c[0].__name__}-{c[1]}" for c in CASES])
def test_typed_error_names_the_field(client, exc, field, kwargs):
    with pytest.raises(exc) as e:
        client.score(**kwargs)
    assert isinstance(e.value, logitserve.LogitserveError)
    assert e.value.code == exc.code
    assert field in e.value.details, e.value.details


def test_nan_hidden_names_the_row(client):
    h = _h(4)
    h[2, 5] = np.nan
    with pytest.raises(logitserve.InvalidArgument) as e:
        client.score(head="policy", hidden=h)
    assert "hidden" in e.value.details and "row 2" in e.value.details


def test_client_side_type_errors(client):
    with pytest.raises(TypeError, match="hidden"):
        client.score(head="policy", hidden=np.ones((2, H), np.int32))
    with pytest.raises(ValueError, match="dtype"):
        client.score(head="policy", hidden=_h(), dtype="fp8")
    with pytest.raises(TypeError, match="target_ids"):
        client.score(head="policy", hidden=_h(), target_ids=[0.5, 1.0, 2.0])


def test_error_classes_map_every_code():
    from logitserve._errors import error_for
    assert isinstance(error_for(grpc.StatusCode.UNAVAILABLE, "x"), logitserve.Unavailable)
    assert isinstance(error_for(3, "x"), logitserve.InvalidArgument)  # google.rpc.Code numbers
    assert isinstance(error_for(16, "x"), logitserve.Unauthenticated)
    assert isinstance(error_for(7, "x"), logitserve.PermissionDenied)
    assert isinstance(error_for(4, "x"), logitserve.DeadlineExceeded)
    assert isinstance(error_for(1, "x"), logitserve.Cancelled)
    assert isinstance(error_for(8, "x"), logitserve.ResourceExhausted)
    e = error_for(9, "pinned")
    assert isinstance(e, logitserve.FailedPrecondition) and e.details == "pinned"
    assert e.code == grpc.StatusCode.FAILED_PRECONDITION
