"""What MII's servers listen on and answer: its REST gateway refuses a bad request with its reason and
answers a failed one with its status, and its internal ports listen on loopback only. Replacements for
MII's, grpc's and zmq's attributes, installed by :mod:`hcache.mii.patches`."""

from __future__ import annotations

import grpc

from ..errors import InvalidRequestError
from .requests import check_rest_body


def http_status(code: grpc.StatusCode) -> int:
    """The HTTP status a REST or OpenAI client gets for a call the deployment answered with ``code``: one
    rule for this gateway and hcache's OpenAI server, which stands on the deployment."""
    return {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAVAILABLE: 503}.get(code, 500)


def checked_rest_gateway(create_app, model_config):
    """``restful_gateway.createRestfulGatewayApp``. MII's gateway answers every error with a bare HTTP 500:
    here a bad request is refused with HTTP 400 and the reason before it reaches the deployment, and one the
    deployment fails is answered with :func:`http_status` and the deployment's message.
    ``model_config``: MII's, of the model the gateway serves (its tokenizer counts a prompt's tokens)."""
    import torch
    from flask import jsonify, request
    from mii.constants import RESTFUL_API_PATH
    from transformers import AutoConfig, AutoTokenizer

    from ..model.spec import ModelSpec

    path = model_config.model_name_or_path
    tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer or path)
    max_length = (
        model_config.max_length or ModelSpec.from_config(AutoConfig.from_pretrained(path), torch.float32).max_positions
    )

    def create_checked_app(deployment_name, server_thread):
        app = create_app(deployment_name, server_thread)
        route = f"/{RESTFUL_API_PATH}/{deployment_name}"

        @app.before_request
        def refuse_bad_request():
            if request.method == "POST" and request.path == route:
                try:
                    check_rest_body(request.get_json(silent=True), tokenizer.encode, max_length)
                except InvalidRequestError as exc:
                    return jsonify({"error": str(exc)}), 400
            return None

        [endpoint] = [rule.endpoint for rule in app.url_map.iter_rules() if rule.rule == route]
        generate = app.view_functions[endpoint]

        def generate_checked(*args, **kwargs):
            try:
                return generate(*args, **kwargs)
            except grpc.RpcError as exc:
                return jsonify({"error": exc.details()}), http_status(exc.code())

        app.view_functions[endpoint] = generate_checked
        return app

    return create_checked_app


# MII binds its internal gRPC servers and rank 0's ZMQ broadcast to every interface: they listen on loopback.
def loopback_grpc_server(make_server):
    """``grpc.server``."""

    def server(*args, **kwargs):
        s = make_server(*args, **kwargs)
        add_port = s.add_insecure_port
        s.add_insecure_port = lambda address: add_port(address.replace("[::]:", "localhost:", 1))
        return s

    return server


def loopback_zmq_bind(bind):
    """``zmq.Socket.bind``."""
    return lambda self, address: bind(self, address.replace("tcp://*:", "tcp://127.0.0.1:", 1))
