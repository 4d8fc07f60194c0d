#!/usr/bin/python3
"""Renders Jinja cases with Jinja2 itself, set up the way Hugging Face transformers renders chat
templates (apply_chat_template / _compile_jinja_template): ImmutableSandboxedEnvironment with
trim_blocks, lstrip_blocks and the loopcontrols extension, transformers' tojson filter
(json.dumps, ensure_ascii=False, key order kept), the raise_exception and strftime_now globals,
and the {% generation %} tag of its AssistantTracker extension (rendered as its body). The C++ chat-template tests compare moelora's renderer against this output.

Run with Debian's interpreter (python3-jinja2), isolated from any other Python setup:

    /usr/bin/python3 -I tests/tokenizer/jinja2_oracle.py CASES.json OUT.jsonl

CASES.json is a list of cases, each one of:
  {"name", "template", "variables"}                 render `template` with `variables`
  {"name", "tokenizer_config", "messages", "add_generation_prompt",
   "tools"?, "documents"?, "extra"?}                 apply a tokenizer's chat template like
                                                      transformers: special tokens + extra +
                                                      messages/tools/documents/add_generation_prompt
OUT.jsonl gets {"name", "text"} or {"name", "error"} per case, in order.
"""
import json
import sys
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

SPECIAL_TOKEN_KEYS = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"]


class GenerationTag(jinja2.ext.Extension):
    """transformers' AssistantTracker tag, outside of assistant-mask tracking: renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def make_environment():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def token_content(value):
    if isinstance(value, dict):
        return value.get("content")
    return value


def chat_variables(case):
    """What transformers' apply_chat_template passes to render()."""
    with open(case["tokenizer_config"], encoding="utf-8") as f:
        config = json.load(f)
    variables = {}
    for key in SPECIAL_TOKEN_KEYS:
        content = token_content(config.get(key))
        if content is not None:
            variables[key] = content
    if config.get("additional_special_tokens"):
        variables["additional_special_tokens"] = [token_content(t) for t in config["additional_special_tokens"]]
    variables.update(case.get("extra") or {})
    variables["messages"] = case["messages"]
    variables["tools"] = case.get("tools")
    variables["documents"] = case.get("documents")
    variables["add_generation_prompt"] = case["add_generation_prompt"]
    template = config["chat_template"]
    if isinstance(template, list):
        templates = {t["name"]: t["template"] for t in template}
        template = templates["tool_use"] if case.get("tools") is not None and "tool_use" in templates else templates["default"]
    return template, variables


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: jinja2_oracle.py CASES.json OUT.jsonl")
    env = make_environment()
    with open(sys.argv[1], encoding="utf-8") as f:
        cases = json.load(f)
    with open(sys.argv[2], "w", encoding="utf-8") as out:
        for case in cases:
            row = {"name": case["name"]}
            try:
                if "tokenizer_config" in case:
                    template, variables = chat_variables(case)
                else:
                    template, variables = case["template"], case["variables"]
                row["text"] = env.from_string(template).render(**variables)
            except Exception as e:  # the C++ side must fail too; messages need not match
                row["error"] = f"{type(e).__name__}: {e}"
            out.write(json.dumps(row, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
