"""Tools the policy calls during a multi-turn rollout, and how a call becomes the tool message.

A tool is an OpenAI function schema (rendered into the prompt by the chat template's ``tools=``)
plus an async ``execute``. ``call_tool`` is the only way the rollout runs one: whatever the tool
does (raise, hang, print megabytes), the trajectory gets a bounded text and flags, never an
exception, so one bad call costs one turn and not the batch.

``tool_config_path`` (verl's format)::

    tools:
      - class_name: engine.rollout.agentic.tools.CalculatorTool
        config: {timeout_s: 5}
        tool_schema:            # optional: the class's default_schema otherwise
          type: function
          function: {name: calc, description: ..., parameters: {...}}
"""
from __future__ import annotations

import abc
import ast
import asyncio
import codecs
import copy
import functools
import importlib
import logging
import math
import operator
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

logger = logging.getLogger(__name__)


class ToolError(ValueError):
    """A bad tool config or schema: the message names the file and the tool entry."""


@dataclass(frozen=True)
class ToolOutcome:
    text: str  # what the model sees as the tool message content
    error: bool  # the tool raised, timed out, got bad arguments, or is unknown
    truncated: bool  # output was cut to the limit
    latency_s: float  # wall time of the call


@dataclass(frozen=True)
class ToolOutput:
    """What ``execute`` may return instead of a str when it knows more than the text: it kept only the
    start of a long output (``total_chars`` counts all of it, a lower bound when ``stopped``), or the
    text is itself the error to show (a script's traceback), not an exception to format."""

    text: str
    total_chars: int
    error: bool = False
    stopped: bool = False  # the producer was stopped for printing too much


class Tool(abc.ABC):
    """A tool the policy can call: an OpenAI function schema + async execute."""

    default_schema: ClassVar[dict]
    # PythonTool kills its child at timeout_s and says so; call_tool's own limit then only backs it up.
    enforces_timeout: ClassVar[bool] = False

    def __init__(self, config: dict | None = None, schema: dict | None = None) -> None:
        self.config = dict(config or {})
        self.schema = copy.deepcopy(schema if schema is not None else self.default_schema)
        _check_schema(self.schema)
        self.timeout_s = float(self.config.get("timeout_s", 10.0))
        self.max_output_chars = int(self.config.get("max_output_chars", 4096))
        if self.timeout_s <= 0 or self.max_output_chars <= 0:
            raise ToolError(f"timeout_s and max_output_chars must be positive, not {self.timeout_s} and "
                            f"{self.max_output_chars}")

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    @abc.abstractmethod
    async def execute(self, arguments: dict, state: dict) -> str | ToolOutput:
        """The tool's answer to one call. ``state`` is a per-trajectory dict the tool may keep things in
        across calls (counters, a session). Raising is fine: ``call_tool`` turns it into an error outcome."""


def _check_schema(schema: Any) -> None:
    function = schema.get("function") if isinstance(schema, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ToolError('a tool schema must be {"type": "function", "function": {"name": ..., "description": ..., '
                        f'"parameters": {{...}}}}, not {schema!r}')
    if not isinstance(function.get("parameters", {}), dict):
        raise ToolError(f"the parameters of tool {function['name']!r} must be a JSON schema object")


def _truncation_marker(total_chars: int, stopped: bool) -> str:
    if stopped:
        return f"\n[... output truncated: more than {total_chars} characters; the program was stopped]"
    return f"\n[... output truncated: {total_chars} characters in all]"


def _short(exc: BaseException) -> str:
    message = str(exc)
    return f"Error: {type(exc).__name__}: {message[:500]}{'...' if len(message) > 500 else ''}"


async def call_tool(tool: Tool, arguments: dict, state: dict) -> ToolOutcome:
    """Runs ``tool.execute`` within ``tool.timeout_s``. An exception -> error outcome
    'Error: <ExceptionType>: <message>'; the time limit -> error outcome naming it; output longer than
    ``max_output_chars`` -> cut there plus a marker, ``truncated=True``. Never raises (but CancelledError)."""
    start = time.monotonic()
    limit_s = tool.timeout_s + (5.0 if tool.enforces_timeout else 0.0)
    # A task and asyncio.wait rather than wait_for: a TimeoutError the tool raises itself (a socket's)
    # must read as that error, not as the tool being out of time.
    task = asyncio.ensure_future(tool.execute(arguments, state))
    try:
        await asyncio.wait({task}, timeout=limit_s)
    finally:
        if not task.done():  # out of time, or this call was cancelled: either way the tool stops
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        output = ToolOutput(f"Error: the tool {tool.name} did not finish within {tool.timeout_s:g} s", 0, error=True)
    elif task.exception() is not None:
        output = ToolOutput(_short(task.exception()), 0, error=True)
    else:
        result = task.result()
        output = result if isinstance(result, ToolOutput) else ToolOutput(str(result), len(str(result)))
    text, limit = output.text, tool.max_output_chars
    total = max(output.total_chars, len(text))
    truncated = output.stopped or total > limit
    if truncated:
        text = text[:limit] + _truncation_marker(total, output.stopped)
    return ToolOutcome(text, output.error, truncated, time.monotonic() - start)


async def call_named(tools: dict[str, Tool], name: str, arguments: Any, state: dict) -> ToolOutcome:
    """``call_tool`` on the tool the model named; an unknown name or non-object arguments are error
    outcomes the model sees, so it can correct itself on the next turn."""
    if name not in tools:
        return ToolOutcome(f"Error: unknown tool {name}; tools: {', '.join(tools)}", True, False, 0.0)
    if not isinstance(arguments, dict):
        return ToolOutcome(f"Error: the arguments of {name} must be a JSON object, not {type(arguments).__name__}",
                           True, False, 0.0)
    return await call_tool(tools[name], arguments, state)


def tool_schemas(tools: dict[str, Tool]) -> list[dict]:
    """The schemas, for the chat template's ``tools=`` argument."""
    return [tool.schema for tool in tools.values()]


def _string_parameter(tool: Tool) -> str:
    """The name of a one-string-argument tool's parameter, read from its schema (so a config may rename it):
    the first required property, else the first property."""
    parameters = tool.schema["function"].get("parameters") or {}
    names = list(parameters.get("required") or []) + list(parameters.get("properties") or {})
    if not names:
        raise ToolError(f"tool {tool.name!r} needs one string parameter in its schema's parameters")
    return names[0]


def _argument(tool: Tool, parameter: str, arguments: dict) -> str:
    value = arguments.get(parameter)
    if not isinstance(value, str):
        raise ValueError(f"{tool.name} takes one string argument {parameter!r}; got {sorted(arguments)}")
    return value


def _one_string_schema(name: str, description: str, parameter: str, about: str) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {parameter: {"type": "string", "description": about}},
                       "required": [parameter]}}}


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 64
_MAX_DIGITS = 1000
_MAX_BITS = int(_MAX_DIGITS * math.log2(10)) + 1


class CalculatorTool(Tool):
    """Arithmetic on int and float literals (+ - * / // % **, unary +/-, parentheses) by walking the
    expression's syntax tree: nothing is evaluated as Python, so names, calls and attributes are errors."""

    default_schema: ClassVar[dict] = _one_string_schema(
        "calculator", "Evaluate an arithmetic expression, e.g. (3 + 4) * 2 / 7 or 2 ** 10.",
        "expression", "The expression: numbers, + - * / // % **, and parentheses.")

    def __init__(self, config: dict | None = None, schema: dict | None = None) -> None:
        super().__init__(config, schema)
        self.parameter = _string_parameter(self)

    async def execute(self, arguments: dict, state: dict) -> str:
        expression = _argument(self, self.parameter, arguments)
        if len(expression) > 2000:  # deep nesting would otherwise recurse in the parser and here
            raise ValueError(f"the expression is {len(expression)} characters long; at most 2000")
        value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
        if isinstance(value, float):
            if not math.isfinite(value):
                raise ValueError("the result is not a finite number")
            # 24/2 is "12", as a person would write it; past 1e15 floats hold no exact integer anyway.
            return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.10g}"
        return str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, str, complex
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        # Checked before computing: 10 ** 10 ** 9 would take minutes and gigabytes. Operands stay under
        # _MAX_BITS (checked below), so a power of at most 64 is cheap to compute and check after.
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"the exponent {right} is larger than {_MAX_EXPONENT}")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex):  # (-8) ** 0.5
            raise ValueError("the result is a complex number")
        if isinstance(value, int) and value.bit_length() > _MAX_BITS:
            raise ValueError(f"the result has more than {_MAX_DIGITS} digits")
        return value
    raise ValueError(f"unsupported expression {ast.unparse(node)!r}: only numbers, + - * / // % ** and "
                     "parentheses are allowed")


@functools.cache
def network_isolation() -> str:
    """How PythonTool keeps its child off the network on this machine: "bubblewrap", "unshare" or
    "none". Probed once (the first PythonTool made), since a container may forbid user namespaces."""
    def works(command: list[str]) -> bool:
        try:
            return subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, timeout=10).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    true = shutil.which("true") or "/bin/true"
    bwrap, unshare = shutil.which("bwrap"), shutil.which("unshare")
    if bwrap and works([bwrap, "--unshare-net", "--die-with-parent", "--ro-bind", "/", "/", "--dev", "/dev",
                        "--proc", "/proc", true]):
        kind = "bubblewrap"
    elif unshare and works([unshare, "--net", "--map-root-user", true]):
        kind = "unshare"
    else:
        kind = "none"
    if kind == "none":
        logger.info("python tool: neither bubblewrap nor `unshare --net` works here, so code the policy runs "
                    "can reach the network on this machine")
    else:
        logger.info("python tool: the policy's code runs without network, isolated by %s", kind)
    return kind


def _isolated(command: list[str], scratch: str) -> list[str]:
    kind = network_isolation()
    if kind == "bubblewrap":
        return [shutil.which("bwrap") or "bwrap", "--unshare-net", "--die-with-parent", "--ro-bind", "/", "/",
                "--bind", scratch, scratch, "--dev", "/dev", "--proc", "/proc", "--chdir", scratch, "--", *command]
    if kind == "unshare":
        return [shutil.which("unshare") or "unshare", "--net", "--map-root-user", *command]
    return command


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # already gone
        pass


class PythonTool(Tool):
    """Runs the policy's Python in a child process: a fresh scratch directory as cwd and HOME (removed
    after), an environment of five variables (no API key or token of ours reaches it), limits on time,
    memory and output, and no network where bubblewrap or user namespaces allow (``network_isolation``)."""

    default_schema: ClassVar[dict] = _one_string_schema(
        "python", "Run a Python 3 program and return what it prints (stdout and stderr). Each call is a fresh "
        "process in an empty directory, with no network.", "code", "The Python program.")
    enforces_timeout: ClassVar[bool] = True
    stop_factor: ClassVar[int] = 4  # stop the child once it printed this many times max_output_chars

    def __init__(self, config: dict | None = None, schema: dict | None = None) -> None:
        super().__init__(config, schema)
        self.parameter = _string_parameter(self)
        self.memory_mb = int(self.config.get("memory_mb", 512))
        network_isolation()  # probe now, at load time, not inside the rollout's event loop

    async def execute(self, arguments: dict, state: dict) -> ToolOutput:
        code = _argument(self, self.parameter, arguments)
        with tempfile.TemporaryDirectory(prefix="trident-python-tool-") as scratch:
            script = Path(scratch, "main.py")
            script.write_text(code)
            env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
                   "PYTHONDONTWRITEBYTECODE": "1"}
            process = await asyncio.create_subprocess_exec(
                *_isolated([sys.executable, "-I", str(script)], scratch), cwd=scratch, env=env,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True, preexec_fn=self._limit_resources)
            try:
                return await self._collect(process)
            finally:
                # Always the whole group: it also ends what the program left running in the background,
                # and runs when the call is cancelled too. asyncio's wait() also waits for the pipe to
                # close, so what the dead child left in it (a pipe's buffer at most) is read first.
                _kill_group(process.pid)
                while await process.stdout.read(65536):
                    pass
                await process.wait()

    def _limit_resources(self) -> None:
        """In the child, before exec: address space, and CPU seconds as a backstop to the wall-clock kill."""
        memory = self.memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        cpu_s = math.ceil(self.timeout_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))

    async def _collect(self, process: asyncio.subprocess.Process) -> ToolOutput:
        """The child's output as it comes, keeping the first max_output_chars; stops the child at the time
        limit, or once it printed stop_factor times the limit (so 10 MB of prints never sit in memory)."""
        assert process.stdout is not None
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        kept: list[str] = []
        kept_chars = total = 0
        stopped = False

        async def read() -> None:
            nonlocal kept_chars, total, stopped
            while chunk := await process.stdout.read(65536):
                text = decoder.decode(chunk)
                total += len(text)
                if kept_chars < self.max_output_chars:
                    kept.append(text[:self.max_output_chars - kept_chars])
                    kept_chars += len(kept[-1])
                if total > self.stop_factor * self.max_output_chars:
                    stopped = True
                    return
            await process.wait()

        try:
            await asyncio.wait_for(read(), self.timeout_s)
        except TimeoutError:
            partial = "".join(kept)
            text = f"Error: the program was killed after {self.timeout_s:g} s (the time limit)"
            text += "; its output until then:\n" if partial else ""
            return ToolOutput(text + partial, len(text) + total, error=True)
        output = "".join(kept)
        if stopped:
            return ToolOutput(output, total, stopped=True)
        if process.returncode != 0:  # the output (a traceback, usually) says why; say it when it does not
            reason = (f"killed by signal {-process.returncode}" if process.returncode < 0
                      else f"exit status {process.returncode}")
            return ToolOutput(output or f"(no output; {reason})", total, error=True)
        return ToolOutput(output or "(no output)", total)


def load_tools(path: str) -> dict[str, Tool]:
    """The tools of a YAML file in verl's format (see the module's docstring), by name. A ToolError names the
    file and the entry: a missing file, no 'tools' list, a class that cannot be imported or is not a Tool,
    a bad schema or config, two tools of one name."""
    from omegaconf import OmegaConf

    if not Path(path).is_file():
        raise ToolError(f"tool config {path} does not exist")
    try:
        content = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as error:  # yaml's and omegaconf's parse and interpolation errors
        raise ToolError(f"{path}: cannot read it as YAML: {error}") from None
    entries = content.get("tools") if isinstance(content, dict) else None
    if not isinstance(entries, list):
        raise ToolError(f"{path}: expected a mapping with a 'tools' list")
    tools: dict[str, Tool] = {}
    for index, entry in enumerate(entries):
        where = f"{path}, tools[{index}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise ToolError(f"{where}: expected a mapping with class_name (and config, tool_schema)")
        unknown = sorted(set(entry) - {"class_name", "config", "tool_schema"})
        if unknown:
            raise ToolError(f"{where}: unknown keys {unknown}; a tool has class_name, config and tool_schema")
        class_name = entry["class_name"]
        module, _, attribute = class_name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError, ValueError) as error:
            raise ToolError(f"{where}: cannot import {class_name!r}: {error}") from None
        if not (isinstance(cls, type) and issubclass(cls, Tool)) or getattr(cls, "__abstractmethods__", None):
            raise ToolError(f"{where}: {class_name} is not a concrete engine.rollout.agentic.tools.Tool")
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ToolError(f"{where}: config must be a mapping, not {config!r}")
        try:
            tool = cls(config, entry.get("tool_schema"))
        except (ToolError, TypeError, ValueError) as error:  # a bad schema, or a config value of the wrong type
            raise ToolError(f"{where} ({class_name}): {error}") from None
        if tool.name in tools:
            raise ToolError(f"{where}: a second tool named {tool.name!r}")
        tools[tool.name] = tool
    return tools
