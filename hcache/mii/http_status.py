"""How a deployment's gRPC answer reaches an HTTP client: one rule for MII's REST gateway and hcache's OpenAI
server (which stands on the deployment, so the rule lives with it)."""
import grpc


def http_status(code: grpc.StatusCode) -> int:
    """The HTTP status a REST or OpenAI client gets for a call the deployment answered with ``code``."""
    return {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAVAILABLE: 503}.get(code, 500)
