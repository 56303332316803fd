"""Request validation: tools, tool_choice and parallel_tool_calls as the OpenAI API accepts them."""

from __future__ import annotations

import re

from errors import InvalidRequest

from .forced import forced_name, tool_parameters

FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
_CHOICE_WORDS = ("none", "auto", "required")


def validate_tools(tools, tool_choice, parallel_tool_calls) -> None:
    """InvalidRequest, with OpenAI's param names, for tools/tool_choice/parallel_tool_calls the API refuses."""
    names = _check_tools(tools) if tools is not None else []
    _check_tool_choice(tool_choice, names)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequest("parallel_tool_calls must be a boolean.", param="parallel_tool_calls")
    _check_forced_schemas(tools or [], tool_choice)


def _check_tools(tools) -> list[str]:
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be an array of function tools.", param="tools")
    names: list[str] = []
    for i, tool in enumerate(tools):
        name = _check_tool(tool, f"tools[{i}]")
        if name in names:
            raise InvalidRequest(f"Duplicate function name {name!r} in tools.", param=f"tools[{i}].function.name")
        names.append(name)
    return names


def _check_tool(tool, param: str) -> str:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidRequest('Each tool must be {"type": "function", "function": {...}}.', param=f"{param}.type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidRequest("A function tool needs a function object.", param=f"{param}.function")
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        raise InvalidRequest(
            "Function names are 1 to 64 letters, digits, underscores or dashes.", param=f"{param}.function.name"
        )
    for key, kind, wanted in (
        ("description", str, "a string"),
        ("parameters", dict, "a JSON schema object"),
        ("strict", bool, "a boolean"),
    ):
        if key in function and function[key] is not None and not isinstance(function[key], kind):
            raise InvalidRequest(f"function.{key} must be {wanted}.", param=f"{param}.function.{key}")
    return name


def _check_tool_choice(tool_choice, names: list[str]) -> None:
    if tool_choice is None or tool_choice in _CHOICE_WORDS:
        if tool_choice == "required" and not names:
            raise InvalidRequest('tool_choice "required" needs tools.', param="tool_choice")
        return
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (
        not isinstance(tool_choice, dict)
        or tool_choice.get("type") != "function"
        or not isinstance(function, dict)
        or not isinstance(function.get("name"), str)
    ):
        raise InvalidRequest(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}.',
            param="tool_choice",
        )
    if function["name"] not in names:
        raise InvalidRequest(
            f"tool_choice names function {function['name']!r}, which is not in tools.", param="tool_choice"
        )


def _check_forced_schemas(tools: list[dict], tool_choice) -> None:
    """A forced choice runs the tools' parameter schemas through the grammar: refuse one it cannot compile.

    Under "auto" or "none" no grammar is built, so a schema only the model reads is not checked.
    """
    from inference.structured_output import StructuredOutputs, check_syntax

    name = forced_name(tool_choice)
    if name is None and tool_choice != "required":
        return
    for i, tool in enumerate(tools):
        if name is not None and tool["function"]["name"] != name:
            continue
        try:
            check_syntax(StructuredOutputs(json=tool_parameters(tool)))
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(
                f"tools[{i}].function.parameters is not a schema the engine can enforce: {exc}",
                param=f"tools[{i}].function.parameters",
            ) from None
