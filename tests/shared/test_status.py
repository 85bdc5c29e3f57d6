import grpc

from pdserve.engine.page_table import OutOfPages
from pdserve.status import engine_error_code


def test_engine_errors_map_to_statuses():
    assert engine_error_code(OutOfPages("no pages")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert engine_error_code(ValueError("duplicate request id 'a'")) == grpc.StatusCode.ALREADY_EXISTS
    assert engine_error_code(ValueError("token id outside the vocabulary")) == grpc.StatusCode.INVALID_ARGUMENT
    assert engine_error_code(RuntimeError("boom")) == grpc.StatusCode.INTERNAL
