import grpc
import pytest

from pdserve.engine.page_table import OutOfPages
from pdserve.errors import CorruptPage, DuplicateRequest, InvalidRequest, UnknownRequest
from pdserve.server.status import engine_error_code


@pytest.mark.parametrize(
    "err, code",
    [
        (OutOfPages("no pages"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (DuplicateRequest("request id 'a' is in flight"), grpc.StatusCode.ALREADY_EXISTS),
        (InvalidRequest("token id outside the vocabulary"), grpc.StatusCode.INVALID_ARGUMENT),
        (CorruptPage("checksum mismatch"), grpc.StatusCode.DATA_LOSS),
        (UnknownRequest("no request 'a'"), grpc.StatusCode.NOT_FOUND),
        # the wording never decides: an untyped error is ours, whatever it says
        (ValueError("duplicate request id 'a'"), grpc.StatusCode.INTERNAL),
        (RuntimeError("boom"), grpc.StatusCode.INTERNAL),
    ],
)
def test_typed_errors_map_to_one_status_each(err, code):
    assert engine_error_code(err) == code


def test_unknown_request_message_is_not_quoted():
    assert str(UnknownRequest("no request 'a'")) == "no request 'a'"
