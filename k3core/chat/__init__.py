"""Chat: requests to prompt ids in the model's chat format, and model output back to reasoning and tool calls.

    from k3core.chat import render_messages, parse_k3_output
    ids = render_messages(llm.tokenizer, messages, tools=tools, thinking=True, thinking_effort="max")
    parsed = parse_k3_output(text)      # .reasoning_content, .content, .tool_calls[i].name / .arguments

`xtml` renders K3's XTML format, `templates` a checkpoint's jinja template in a sandbox, `render` picks between
them, `parsers` reads K3 output and `k2_parsers` Kimi-Linear's (K2-style tool calls), whole or streamed.
"""
from k3core.chat.k2_parsers import K2OutputParser, parse_k2_output
from k3core.chat.parsers import K3OutputParser, ParsedDelta, ParsedOutput, ToolCall, parse_k3_output
from k3core.chat.render import chat_format, render_messages
from k3core.chat.templates import TemplateError
from k3core.chat.xtml import XtmlError

__all__ = ["K2OutputParser", "K3OutputParser", "ParsedDelta", "ParsedOutput", "TemplateError", "ToolCall", "XtmlError",
           "chat_format", "parse_k2_output", "parse_k3_output", "render_messages"]
