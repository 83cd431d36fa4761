"""Every ErrorInfo / report reason the protos document is one the code sends, and every service
sends none its protos leave out: both directions, for each of the four services.

Documented reasons are the UPPER_SNAKE words in the protos' comments that are not enum values
(with or without their enum's prefix), gRPC code names, or the few other words listed in
NOT_REASONS. Sent reasons are read from the code's syntax tree: `reason = "X"` on an error
class or anywhere a name or attribute ending in `reason` is assigned, `reason="X"` keyword
arguments, "X" passed where a function or class of swerl takes a `reason` parameter, and "X"
as the default of a parameter whose name ends in `reason`.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

import grpc
import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTOS = sorted((ROOT / "protos").rglob("*.proto"))
EXEC_PROTOS = [p for p in PROTOS if p.parent.parent.name == "exec"]
ALL_CODE = [*(ROOT / "services").rglob("*.py"), *(ROOT / "swerl").rglob("*.py")]
# What the exec node runs: its own package and the chassis pieces that raise on its calls.
EXEC_CODE = [
    *(ROOT / "services" / "exec").rglob("*.py"),
    ROOT / "swerl" / "chassis" / "errors.py",
    ROOT / "swerl" / "chassis" / "capability.py",
]
# Upper-case words in proto comments that are not reasons: SWE-bench columns, an env variable.
# Column and environment-variable names that proto comments mention beside reasons.
NOT_REASONS = frozenset({"FAIL_TO_PASS", "PASS_TO_PASS", "TQDM_DISABLE", "PIP_INDEX_URL"})
GRPC_CODES = frozenset(code.name for code in grpc.StatusCode)
_WORD = re.compile(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b")
_REASON = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+")


# Each service: the protos whose reasons it may send (its own, then those of the services whose
# reasons it passes on: the pool answers with its nodes' reasons, the agent builds evaluation
# reports and relays the pool's), and the code it runs (its package and the chassis).
SERVICE_PROTOS: dict[str, tuple[str, ...]] = {
    "exec": ("exec",),
    "pool": ("pool", "exec"),
    "agent": ("agent", "exec", "pool"),
    "prm": ("prm",),
}
# The chassis' auth errors are every service's; lease capability tokens only the exec node's.
CHASSIS_CODE = [ROOT / "swerl" / "chassis" / "errors.py"]
EXEC_ONLY_CHASSIS_CODE = [ROOT / "swerl" / "chassis" / "capability.py"]


def service_protos(*services: str) -> list[Path]:
    return [p for p in PROTOS if p.parent.parent.name in services]


def service_code(service: str) -> list[Path]:
    extra = EXEC_ONLY_CHASSIS_CODE if service == "exec" else []
    return [*(ROOT / "services" / service).rglob("*.py"), *CHASSIS_CODE, *extra]


def _enum_values(text: str) -> set[str]:
    values: set[str] = set()
    for match in re.finditer(r"enum (\w+) \{(.*?)\}", text, re.DOTALL):
        prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", match.group(1)).upper() + "_"
        for value in re.findall(r"^\s*([A-Z0-9_]+)\s*=", match.group(2), re.MULTILINE):
            values |= {value, value.removeprefix(prefix)}
    return values


def documented_reasons(protos: Iterable[Path], *, with_enum_values: bool = False) -> dict[str, str]:
    """Reason -> the proto that names it. With `with_enum_values`, words that are also enum
    values count too (the agent's error_reason SANDBOX_BROKEN is its EpisodeStatus's name)."""
    texts = {proto: proto.read_text() for proto in protos}
    enum_values: set[str] = set()
    if not with_enum_values:
        # Every proto's enums: a comment may name another package's enum value.
        enum_values = set().union(*(_enum_values(proto.read_text()) for proto in PROTOS))
    found: dict[str, str] = {}
    for proto, text in texts.items():
        for line in text.splitlines():
            if "//" not in line:
                continue
            for word in _WORD.findall(line.split("//", 1)[1]):
                if word not in enum_values | GRPC_CODES | NOT_REASONS:
                    found.setdefault(word, proto.name)
    return found


def _reason_positions(trees: Iterable[ast.Module]) -> dict[str, int]:
    """Callable name -> index of its `reason` parameter among the call's positional args."""
    positions: dict[str, int] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                init = next(
                    (
                        item
                        for item in node.body
                        if isinstance(item, ast.FunctionDef) and item.name == "__init__"
                    ),
                    None,
                )
                functions = [(node.name, init)] if init else []
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions = [(node.name, node)]
            else:
                continue
            for name, function in functions:
                params = [arg.arg for arg in function.args.args]
                if params and params[0] in ("self", "cls"):
                    params = params[1:]
                if "reason" in params:
                    positions[name] = params.index("reason")
    return positions


def sent_reasons(sources: dict[str, str]) -> dict[str, str]:
    """Reason -> a file that sends it, from Python sources (path -> text)."""
    trees = {path: ast.parse(text) for path, text in sources.items()}
    positions = _reason_positions(trees.values())
    found: dict[str, str] = {}

    def take(value: ast.AST | None, path: str) -> None:
        if (
            isinstance(value, ast.Constant)
            and isinstance(value.value, str)
            and _REASON.fullmatch(value.value)
        ):
            found.setdefault(value.value, path)

    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    name = getattr(target, "id", getattr(target, "attr", ""))
                    if name.endswith("reason"):
                        take(node.value, path)
            elif isinstance(node, ast.Call):
                for keyword in node.keywords:
                    if keyword.arg and keyword.arg.endswith("reason"):
                        take(keyword.value, path)
                callee = getattr(node.func, "id", getattr(node.func, "attr", ""))
                if callee in positions and len(node.args) > positions[callee]:
                    take(node.args[positions[callee]], path)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.args
                for arg, default in zip(
                    args[len(args) - len(node.args.defaults) :], node.args.defaults, strict=True
                ):
                    if arg.arg.endswith("reason"):
                        take(default, path)
    return found


def _sources(paths: Iterable[Path]) -> dict[str, str]:
    return {
        str(path.relative_to(ROOT)): path.read_text()
        for path in paths
        if not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))
    }


def test_every_reason_a_proto_documents_is_one_the_code_sends():
    documented = documented_reasons(PROTOS)
    sent = sent_reasons(_sources(ALL_CODE))
    missing = {reason: proto for reason, proto in documented.items() if reason not in sent}
    assert not missing, f"documented in the protos but never sent by the code: {missing}"


def undocumented_reasons(service: str) -> dict[str, str]:
    """Reasons `service`'s code sends that none of its protos names."""
    documented = documented_reasons(service_protos(*SERVICE_PROTOS[service]), with_enum_values=True)
    sent = sent_reasons(_sources(service_code(service)))
    return {
        reason: path
        for reason, path in sent.items()
        if reason not in documented and reason not in GRPC_CODES
    }


def unsent_reasons(service: str) -> dict[str, str]:
    """Reasons `service`'s own protos document that neither it nor a service it relays sends."""
    documented = documented_reasons(service_protos(service))
    code = [path for name in SERVICE_PROTOS[service] for path in service_code(name)]
    sent = sent_reasons(_sources(code))
    return {reason: proto for reason, proto in documented.items() if reason not in sent}


@pytest.mark.parametrize("service", sorted(SERVICE_PROTOS))
def test_every_reason_a_service_sends_is_documented_in_its_protos(service):
    undocumented = undocumented_reasons(service)
    assert not undocumented, f"sent by the {service} service but not in its protos: {undocumented}"


@pytest.mark.parametrize("service", sorted(SERVICE_PROTOS))
def test_every_reason_a_service_proto_documents_is_sent_by_that_service(service):
    unsent = unsent_reasons(service)
    assert not unsent, f"documented for the {service} service but never sent: {unsent}"


def test_a_reason_sent_but_documented_in_no_proto_is_caught():
    sources = _sources(service_code("prm"))
    errors = "services/prm/errors.py"
    sources[errors] += '\n\nclass Invented(Exception):\n    reason = "INVENTED_REASON"\n'
    documented = documented_reasons(service_protos("prm"), with_enum_values=True)
    assert "INVENTED_REASON" in sent_reasons(sources)
    assert "INVENTED_REASON" not in documented
    assert "ISSUE_MISSING" in documented


def test_removing_a_documented_reason_from_the_code_is_caught():
    sources = _sources(ALL_CODE)
    evaluate = "services/exec/evaluate.py"
    assert '"NO_TEST_RESULTS"' in sources[evaluate]
    sources[evaluate] = sources[evaluate].replace('"NO_TEST_RESULTS"', '"SOMETHING_ELSE"')
    assert "NO_TEST_RESULTS" in documented_reasons(EXEC_PROTOS)
    assert "NO_TEST_RESULTS" not in sent_reasons(sources)


def test_the_extractors_see_each_way_a_reason_is_sent():
    sent = sent_reasons(_sources(EXEC_CODE))
    assert sent["SANDBOX_NOT_FOUND"].endswith("errors.py")  # an error class attribute
    assert sent["PATCH_APPLY_FAILED"].endswith("evaluate.py")  # a `reason` parameter
    assert sent["INSTALL_STEP_FAILED"].endswith("evaluate.py")  # a reason= keyword
    assert sent["REGISTRY_AUTH"].endswith("images.py")  # a `reason` variable
    documented = documented_reasons(EXEC_PROTOS)
    assert documented["EMPTY_PATCH"] == "evaluate.proto"
    assert "EVALUATION_STATUS_INFRA_ERROR" not in documented and "INFRA_ERROR" not in documented
