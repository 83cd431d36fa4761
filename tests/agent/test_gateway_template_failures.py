"""OpenSession with a chat template that cannot render is INVALID_ARGUMENT carrying the
template's own error (a syntax error, a template that raises, template kwargs it refuses), and
template kwargs that would set the gateway's own rendering parameters are refused by name; on a
real agent gRPC server with its gateway port."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import pytest
from google.protobuf import struct_pb2
from testkit.gateway import TOKENIZER

from swerl.agent.server import AgentServer
from swerl.agent.settings import AgentSettings
from swerl.agent.v1 import agent_pb2 as pb
from swerl.agent.v1 import agent_pb2_grpc
from swerl.chassis.client import error_info, make_channel

TOKEN = "gateway-template-token"
# A working template (system and user turns, assistant turns closed by <|im_end|>) with a
# switch a template kwarg sets.
FLAVOURED = (
    "{% if flavour is defined and flavour is not string %}"
    "{{ raise_exception('flavour must be a string, got ' ~ flavour) }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class NoSandboxes:
    def lease(self, *args, **kwargs):
        raise AssertionError("no episode runs in these tests")


@pytest.fixture
async def stub():
    settings = AgentSettings(
        host="127.0.0.1",
        port=0,
        auth_token=TOKEN,
        log_level="warning",
        tokenizer_processes=0,
        gateway_port=0,
    )
    server = AgentServer(settings, provider=NoSandboxes())  # type: ignore[arg-type]
    await server.start()
    channel = make_channel(server.address, token=TOKEN)
    try:
        yield agent_pb2_grpc.AgentServiceStub(channel)
    finally:
        await channel.close()
        await server.stop(0)


def _tokenizer_with(tmp_path: Path, template: str) -> str:
    out = tmp_path / "tokenizer"
    shutil.copytree(TOKENIZER, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    for extra in ("chat_template.jinja", "chat_template.json"):
        (out / extra).unlink(missing_ok=True)
    return str(out)


def _open(tokenizer: str, **template_kwargs: object) -> pb.OpenSessionRequest:
    kwargs = struct_pb2.Struct()
    kwargs.update(template_kwargs)
    return pb.OpenSessionRequest(
        policy=pb.PolicyConfig(endpoint="http://127.0.0.1:9", tokenizer_path=tokenizer),
        template_kwargs=kwargs,
    )


async def _refusal(stub, request: pb.OpenSessionRequest) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.OpenSession(request, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return err.value


async def test_a_template_with_a_syntax_error_is_invalid_argument_with_jinjas_message(
    stub, tmp_path: Path
) -> None:
    path = _tokenizer_with(tmp_path, "{% for m in messages %}{{ m.content }")
    err = await _refusal(stub, _open(path))
    assert error_info(err)[0] == "TOKENIZER_UNAVAILABLE"
    assert "TemplateSyntaxError" in err.details()
    assert "unexpected '}'" in err.details()


async def test_a_template_that_raises_is_invalid_argument_with_its_own_message(
    stub, tmp_path: Path
) -> None:
    path = _tokenizer_with(tmp_path, "{{ raise_exception('this template takes no tools') }}")
    err = await _refusal(stub, _open(path))
    assert error_info(err)[0] == "TOKENIZER_UNAVAILABLE"
    assert "this template takes no tools" in err.details()


async def test_template_kwargs_the_template_refuses_are_invalid_argument(
    stub, tmp_path: Path
) -> None:
    path = _tokenizer_with(tmp_path, FLAVOURED)
    err = await _refusal(stub, _open(path, flavour=3))
    assert error_info(err)[0] == "TOKENIZER_UNAVAILABLE"
    assert "flavour must be a string, got 3" in err.details()
    assert "template_kwargs" in err.details()
    # The same template with kwargs it takes opens a session.
    opened = await stub.OpenSession(_open(path, flavour="plain"), timeout=60)
    assert opened.session_id


@pytest.mark.parametrize("name", ["tokenize", "add_generation_prompt", "return_dict"])
async def test_template_kwargs_naming_the_gateways_own_parameters_are_refused(
    stub, name: str
) -> None:
    err = await _refusal(stub, _open(TOKENIZER, **{name: True}))
    assert error_info(err)[0] == "INVALID_SESSION_SPEC"
    assert f"template_kwargs may not set {name}" in err.details()
