"""Tools for multi-turn rollouts: the calculator, the sandboxed Python tool, call_tool's limits, and load_tools."""
from __future__ import annotations

import asyncio
import os
import textwrap
import time

import psutil
import pytest

from engine.rollout.agentic.tools import (
    CalculatorTool,
    PythonTool,
    Tool,
    ToolError,
    ToolOutcome,
    call_named,
    call_tool,
    load_tools,
    network_isolation,
    tool_schemas,
)


def calculate(expression: str, tool: Tool | None = None, parameter: str = "expression") -> ToolOutcome:
    return asyncio.run(call_tool(tool or CalculatorTool(), {parameter: expression}, {}))


def run_python(code: str, **config) -> ToolOutcome:
    return asyncio.run(call_tool(PythonTool(config), {"code": textwrap.dedent(code)}, {}))


@pytest.mark.parametrize("expression, expected", [
    ("47*83", "3901"), ("2**10", "1024"), ("(3+4)/2", "3.5"), ("24/2", "12"), ("-(7 // 2) + 10 % 4", "-1"),
    ("1/3", "0.3333333333"),
])
def test_the_calculator_computes(expression, expected):
    outcome = calculate(expression)
    assert (outcome.text, outcome.error, outcome.truncated) == (expected, False, False)


@pytest.mark.parametrize("expression", ["__import__('os')", "a+1", "2**100000", "(10**60)**60", "1/0", "True+1",
                                        "(-8)**0.5", "'ab'*3", "().__class__"])
def test_the_calculator_refuses_what_is_not_arithmetic_or_too_big(expression):
    outcome = calculate(expression)
    assert outcome.error and outcome.text.startswith("Error"), outcome


def test_a_schema_can_rename_the_calculator_and_its_parameter():
    schema = {"type": "function", "function": {
        "name": "calc", "description": "arithmetic",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}
    tool = CalculatorTool(schema=schema)
    assert tool.name == "calc"
    assert calculate("6*7", tool, parameter="expr").text == "42"
    # The default name is gone: the model is told which argument it missed.
    outcome = calculate("6*7", tool, parameter="expression")
    assert outcome.error and "'expr'" in outcome.text


class _Raising(Tool):
    default_schema = {"type": "function", "function": {"name": "raising", "parameters": {}}}

    async def execute(self, arguments, state):
        raise RuntimeError("the backend is down")


class _Sleeping(Tool):
    default_schema = {"type": "function", "function": {"name": "sleeping", "parameters": {}}}

    async def execute(self, arguments, state):
        await asyncio.sleep(5)
        return "woke up"


class _OwnTimeout(Tool):
    default_schema = {"type": "function", "function": {"name": "own_timeout", "parameters": {}}}

    async def execute(self, arguments, state):
        raise TimeoutError("the upstream socket timed out")


class _Verbose(Tool):
    default_schema = {"type": "function", "function": {"name": "verbose", "parameters": {}}}

    async def execute(self, arguments, state):
        state["calls"] = state.get("calls", 0) + 1
        return "x" * 10_000_000


def test_a_raising_tool_is_an_error_outcome_naming_the_exception():
    outcome = asyncio.run(call_tool(_Raising(), {}, {}))
    assert outcome.error and outcome.text == "Error: RuntimeError: the backend is down"


def test_a_tool_past_its_time_limit_is_stopped():
    outcome = asyncio.run(call_tool(_Sleeping({"timeout_s": 0.2}), {}, {}))
    assert outcome.error and outcome.text == "Error: the tool sleeping did not finish within 0.2 s"
    assert outcome.latency_s < 1.0


def test_a_timeout_the_tool_raises_itself_is_not_reported_as_the_time_limit():
    outcome = asyncio.run(call_tool(_OwnTimeout(), {}, {}))
    assert outcome.error and outcome.text == "Error: TimeoutError: the upstream socket timed out"


def test_a_long_output_is_cut_to_the_limit_with_a_marker():
    state: dict = {}
    outcome = asyncio.run(call_tool(_Verbose({"max_output_chars": 1000}), {}, state))
    assert outcome.truncated and not outcome.error
    assert outcome.text.startswith("x" * 1000) and len(outcome.text) < 1100
    assert outcome.text.endswith("[... output truncated: 10000000 characters in all]")
    assert state == {"calls": 1}


def test_call_named_answers_an_unknown_tool_or_bad_arguments_with_an_error_outcome():
    tools = {"calculator": CalculatorTool(), "raising": _Raising()}
    unknown = asyncio.run(call_named(tools, "search", {"q": "x"}, {}))
    assert unknown.error and unknown.text == "Error: unknown tool search; tools: calculator, raising"
    not_a_dict = asyncio.run(call_named(tools, "calculator", "2+2", {}))
    assert not_a_dict.error and "JSON object" in not_a_dict.text
    assert asyncio.run(call_named(tools, "calculator", {"expression": "2+2"}, {})).text == "4"


def test_python_prints():
    outcome = run_python("print('hi')")
    assert (outcome.text.strip(), outcome.error, outcome.truncated) == ("hi", False, False)
    assert run_python("x = 1").text == "(no output)"


def test_python_does_not_see_our_secrets(monkeypatch):
    monkeypatch.setenv("TRIDENT_ROLLOUT_API_KEY", "sk-rollout-secret-1234")
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-5678")
    outcome = run_python("""
        import os
        print(os.environ.get('TRIDENT_ROLLOUT_API_KEY'), os.environ.get('WANDB_API_KEY'))
        print(dict(os.environ))
    """)
    assert not outcome.error, outcome
    assert "secret" not in outcome.text and outcome.text.startswith("None None")


def test_python_past_its_time_limit_is_killed_with_its_children():
    ours = set(psutil.Process().children(recursive=True))  # this pytest process's own (its forkservers)
    outcome = run_python("""
        import os, subprocess, sys
        child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
        print(os.getpid(), child.pid, flush=True)
        while True:
            pass
    """, timeout_s=1)
    assert outcome.error and "killed after 1 s" in outcome.text, outcome
    assert outcome.latency_s < 5
    assert set(psutil.Process().children(recursive=True)) - ours == set()
    # The orphaned grandchild got SIGKILL too: it is gone, or a zombie until init reaps it.
    pids = [int(pid) for pid in outcome.text.splitlines()[-1].split()]
    deadline = time.monotonic() + 3
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_python_printing_megabytes_is_cut_and_stopped():
    outcome = run_python("print('x' * 10_000_000)", max_output_chars=2000)
    assert outcome.truncated and not outcome.error
    assert outcome.text.startswith("x" * 2000) and len(outcome.text) < 2 * 2000
    assert outcome.latency_s < 5


def test_a_failing_script_is_an_error_with_its_traceback():
    outcome = run_python("print('before')\n1 / 0")
    assert outcome.error and "ZeroDivisionError" in outcome.text and outcome.text.startswith("before")
    assert run_python("import sys; sys.exit(3)").text == "(no output; exit status 3)"


def test_python_runs_in_a_scratch_directory_that_is_removed():
    outcome = run_python("""
        import os
        with open('notes.txt', 'w') as f:
            f.write('scratch')
        print(os.getcwd(), os.environ['HOME'], os.path.abspath('notes.txt'), sep='\\n')
    """)
    assert not outcome.error, outcome
    cwd, home, written = outcome.text.split()
    assert home == cwd and written == os.path.join(cwd, "notes.txt")
    assert cwd != os.getcwd() and not os.path.exists(cwd)


def test_python_memory_is_limited():
    outcome = run_python("x = bytearray(400 * 2**20)", memory_mb=256)
    assert outcome.error and "MemoryError" in outcome.text


def test_python_has_no_network_where_the_machine_allows():
    if network_isolation() == "none":
        pytest.skip("neither bubblewrap nor unshare --net works on this machine")
    outcome = run_python("import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)")
    assert outcome.error and "Error" in outcome.text, outcome


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "tools.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_load_tools_reads_verls_format(tmp_path):
    path = _write(tmp_path, """
        tools:
          - class_name: engine.rollout.agentic.tools.CalculatorTool
            config: {timeout_s: 5}
          - class_name: engine.rollout.agentic.tools.PythonTool
            config: {timeout_s: 3, memory_mb: 256, max_output_chars: 1000}
          - class_name: engine.rollout.agentic.tools.CalculatorTool
            tool_schema:
              type: function
              function:
                name: calc
                description: arithmetic
                parameters: {type: object, properties: {expr: {type: string}}, required: [expr]}
    """)
    tools = load_tools(path)
    assert list(tools) == ["calculator", "python", "calc"]
    assert tools["calculator"].timeout_s == 5.0
    assert (tools["python"].timeout_s, tools["python"].memory_mb, tools["python"].max_output_chars) == (3.0, 256, 1000)
    assert [schema["function"]["name"] for schema in tool_schemas(tools)] == ["calculator", "python", "calc"]
    assert asyncio.run(call_named(tools, "calc", {"expr": "6*7"}, {})).text == "42"


@pytest.mark.parametrize("entries, expected", [
    ("  - class_name: engine.rollout.agentic.tools.NoSuchTool\n", "tools[0]: cannot import"),
    ("  - class_name: no_such_package.Tool\n", "tools[0]: cannot import"),
    ("  - class_name: engine.rollout.agentic.tools.CalculatorTool\n  - class_name: collections.OrderedDict\n",
     "tools[1]: collections.OrderedDict is not"),
    ("  - class_name: engine.rollout.agentic.tools.CalculatorTool\n"
     "  - class_name: engine.rollout.agentic.tools.CalculatorTool\n", "tools[1]: a second tool named 'calculator'"),
    ("  - class_name: engine.rollout.agentic.tools.CalculatorTool\n    tool_schema: {type: function}\n",
     "tools[0] (engine.rollout.agentic.tools.CalculatorTool): a tool schema must be"),
    ("  - class_name: engine.rollout.agentic.tools.CalculatorTool\n    configs: {timeout_s: 5}\n",
     "tools[0]: unknown keys ['configs']"),
])
def test_load_tools_names_the_file_and_the_entry(tmp_path, entries, expected):
    path = _write(tmp_path, "tools:\n" + entries)
    with pytest.raises(ToolError) as caught:
        load_tools(path)
    assert f"{path}, {expected}" in str(caught.value)


@pytest.mark.parametrize("text", [None, "tools: {calculator: 1}\n", "- just a list\n"])
def test_load_tools_refuses_a_missing_file_or_no_tools_list(tmp_path, text):
    path = str(tmp_path / "tools.yaml") if text is None else _write(tmp_path, text)
    with pytest.raises(ToolError, match=path):
        load_tools(path)
