"""How a deployment's gRPC answer reaches an HTTP client: one rule for the REST gateway and the OpenAI API."""
import grpc


def http_status(code: grpc.StatusCode) -> int:
    """The HTTP status a REST or OpenAI client gets for a call the deployment answered with ``code``."""
    return {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAVAILABLE: 503}.get(code, 500)
