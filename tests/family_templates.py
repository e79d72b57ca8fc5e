"""Chat templates in each family's documented tool-calling syntax, written for these tests (the
models' own templates are not reachable offline), and tiny models that carry them.

Each renders `tools`, assistant `tool_calls` and `tool` results the way its family does:
Qwen2.5/Qwen3/Hermes (<tool_call> blocks, <tool_response> in a user turn, <think> reasoning,
enable_thinking), Mistral v0.3 ([AVAILABLE_TOOLS], [TOOL_CALLS] with 9-character ids,
[TOOL_RESULTS]), Llama 3.1 (ipython environment, JSON calls with "parameters") and Qwen3-Coder
(XML calls: <function=NAME> with <parameter=KEY> values as raw text). Phi-4-mini's is its own
(published in its tokenizer_config.json, and short): the tools are a system message's field.
GLM-4-0414's follows its template's structure: a call's name is its turn's `metadata`.
The end of turn is the tiny tokenizer's EOS, <|end|>."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

LAST_USER = ("{%- set ns = namespace(last_user=-1) %}{%- for m in messages %}{% if m.role == 'user' %}"
             "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}")

QWEN = (
    LAST_USER + "{%- if tools %}<|system|>\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n\n"
    "For each function call, return a json object within <tool_call></tool_call> tags:\n"
    "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|end|>\n"
    "{%- elif messages[0].role == 'system' %}<|system|>\n{{ messages[0].content }}<|end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'assistant' %}\n<|assistant|>\n"
    "{%- if m.reasoning_content and loop.index0 > ns.last_user %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}{% if not loop.first or m.content %}\n{% endif %}"
    "<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|end|>"
    "{%- elif m.role == 'tool' %}\n<|user|>\n<tool_response>\n{{ m.content }}\n</tool_response><|end|>"
    "{%- else %}\n<|{{ m.role }}|>\n{{ m.content }}<|end|>{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}\n<|assistant|>\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% elif open_think %}<think>\n{% endif %}{% endif %}"   # (open_think: as Qwen3-Thinking-2507's)
)

MISTRAL = (
    LAST_USER + "{{ bos_token }}{%- for m in messages %}"
    "{%- if m.role == 'user' %}"
    "{%- if tools and loop.index0 == ns.last_user %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST]{{ m.content }}[/INST]"
    "{%- elif m.role == 'system' %}[INST]{{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}"
    "{% if c.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}, \"id\": \"{{ c.id }}\"}"
    "{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}"
    "{%- elif m.role == 'assistant' %}{{ m.content }}{{ eos_token }}"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{\"content\": {{ m.content | tojson }}, "
    "\"call_id\": \"{{ m.tool_call_id }}\"}[/TOOL_RESULTS]"
    "{%- endif %}{%- endfor %}"
)

LLAMA31 = (
    LAST_USER + "{{ bos_token }}<|system|>\n{% if tools %}Environment: ipython\n{% endif %}Cutting Knowledge Date: December 2023\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}<|end|>"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}"
    "{%- elif m.role == 'user' %}\n<|user|>\n"
    "{%- if tools and loop.index0 == ns.last_user %}Given the following functions, respond with a JSON for a function call "
    "with its proper arguments that best answers the given prompt.\n\nRespond in the format "
    "{\"name\": function name, \"parameters\": dictionary of argument name and its value}. "
    "Do not use variables.\n\n{% for t in tools %}{{ t | tojson(indent=4) }}\n\n{% endfor %}{% endif %}"
    "{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' and m.tool_calls %}\n<|assistant|>\n"
    "{%- for c in m.tool_calls %}{\"name\": \"{{ c.function.name }}\", \"parameters\": "
    "{{ c.function.arguments | tojson }}}{% endfor %}<|end|>"
    "{%- elif m.role == 'assistant' %}\n<|assistant|>\n{{ m.content }}<|end|>"
    "{%- elif m.role in ('tool', 'ipython') %}\n<|ipython|>\n{{ m.content | tojson if m.content is mapping "
    "else m.content }}<|end|>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}\n<|assistant|>\n{% endif %}"
)

QWEN_XML = (   # Qwen3-Coder: tools listed in XML, calls as <function=...> with raw-text <parameter=...> values
    "{%- if tools %}<|system|>\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou have access to the following functions:\n\n<tools>"
    "{% for t in tools %}\n<function>\n<name>{{ t.function.name }}</name>"
    "{% if t.function.description %}\n<description>{{ t.function.description }}</description>{% endif %}"
    "\n<parameters>{% for k, v in (t.function.parameters.properties or {}).items() %}"
    "\n<parameter>\n<name>{{ k }}</name>\n<type>{{ v.type or 'string' }}</type>\n</parameter>{% endfor %}"
    "\n</parameters>\n</function>{% endfor %}\n</tools>\n\n"
    "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "</function>\n</tool_call><|end|>\n"
    "{%- elif messages[0].role == 'system' %}<|system|>\n{{ messages[0].content }}<|end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'assistant' %}\n<|assistant|>\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}{% if not loop.first or m.content %}\n{% endif %}"
    "<tool_call>\n<function={{ c.function.name }}>\n{% for k, v in c.function.arguments.items() %}"
    "<parameter={{ k }}>\n{{ v if v is string else v | tojson }}\n</parameter>\n{% endfor %}</function>\n</tool_call>"
    "{%- endfor %}<|end|>"
    "{%- elif m.role == 'tool' %}\n<|user|>\n<tool_response>\n{{ m.content }}\n</tool_response><|end|>"
    "{%- else %}\n<|{{ m.role }}|>\n{{ m.content }}<|end|>{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}\n<|assistant|>\n{% endif %}"
)

GLM45 = (   # GLM-4.5 (4.6, 4.7): tools as JSON lines, a call as <tool_call>NAME then <arg_key>/<arg_value> pairs
    LAST_USER + "[gMASK]<sop>"
    "{%- if tools %}<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n\n"
    "For each function call, output the function name and arguments within the following XML format:\n"
    "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n...\n"
    "</tool_call>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}<|system|>\n{{ m.content }}"
    "{%- elif m.role == 'user' %}<|user|>\n{{ m.content }}"
    "{%- elif m.role == 'assistant' %}<|assistant|>"
    "{%- if m.reasoning_content and loop.index0 > ns.last_user %}\n<think>{{ m.reasoning_content }}</think>"
    "{%- else %}\n<think></think>{% endif %}"
    "{%- if m.content %}\n{{ m.content }}{% endif %}"
    "{%- for c in m.tool_calls or [] %}\n<tool_call>{{ c.function.name }}\n"
    "{% for k, v in c.function.arguments.items() %}<arg_key>{{ k }}</arg_key>\n"
    "<arg_value>{{ v if v is string else v | tojson }}</arg_value>\n{% endfor %}</tool_call>{% endfor %}"
    "{%- elif m.role == 'tool' %}<|observation|>\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)

HARMONY = (   # gpt-oss: a system and a developer message, channels, calls addressed to functions.NAME
    "{%- set ns = namespace(last_user=-1, last_tool='') %}{%- for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\n\nReasoning: {{ reasoning_effort if reasoning_effort is defined else 'medium' }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "{% if tools %}{{ '\\n' }}Calls to these tools must go to the commentary channel: 'functions'.{% endif %}<|end|>"
    "{%- if messages[0].role == 'system' or tools %}<|start|>developer<|message|>"
    "{%- if messages[0].role == 'system' %}# Instructions\n\n{{ messages[0].content }}\n\n{% endif %}"
    "{%- if tools %}# Tools\n\n## functions\n\nnamespace functions {\n"
    "{% for t in tools %}\n// {{ t.function.description or '' }}\ntype {{ t.function.name }} = "
    "(_: {{ (t.function.parameters or {}) | tojson }}) => any;\n{% endfor %}\n} // namespace functions{% endif %}"
    "<|end|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' and m.tool_calls %}"
    "{%- if m.thinking and loop.index0 > ns.last_user %}<|start|>assistant<|channel|>analysis<|message|>"
    "{{ m.thinking }}<|end|>{% endif %}"
    "{%- for c in m.tool_calls %}<|start|>assistant to=functions.{{ c.function.name }}<|channel|>commentary json"
    "<|message|>{{ c.function.arguments | tojson }}<|call|>{% set ns.last_tool = c.function.name %}{% endfor %}"
    "{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' %}<|start|>functions.{{ m.name or ns.last_tool }} to=assistant<|channel|>commentary"
    "<|message|>{{ m.content | tojson }}<|end|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif %}"
)
# Phi-4-mini's own template (microsoft/Phi-4-mini-instruct, mlx-community/Phi-4-mini-instruct-4bit): a
# system message's `tools` field between <|tool|> and <|/tool|>, every message `<|role|>content<|end|>`
PHI4_MINI = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and "
    "message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + "
    "message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + "
    "message['content'] + '<|end|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)
PHI4_TOKENS = ("<|tool|>", "<|/tool|>", "<|tool_call|>", "<|/tool_call|>")   # special, as in its tokenizer


def phi4_mini_model(model_dirs, out_dir: Path) -> Path:
    """The tiny phi3 model (Phi-4-mini's architecture) with Phi-4-mini's template and tool tokens;
    its EOS is <|end|>, as Phi-4-mini's is."""
    return with_template(model_dirs("phi3", special=PHI4_TOKENS), out_dir, PHI4_MINI)


# GLM-4-0414's structure (THUDM/GLM-4-32B-0414): `tools` listed in a system turn by the template, a
# past call an assistant turn whose `metadata` is the tool's name (then a space, a newline and its
# arguments), a result an `observation` turn; a text reply begins with a newline
GLM4_0414 = (
    "[gMASK]<sop>{%- if tools -%}<|system|>\n# 可用工具{% for tool in tools %}"
    "{%- set function = tool.function if tool.get('function') else tool %}\n\n## {{ function.name }}\n\n"
    "{{ function | tojson(indent=4) }}\n在调用上述函数时，请使用 Json 格式表示调用的参数。{%- endfor %}{%- endif -%}"
    "{%- for msg in messages %}{%- if msg.role == 'system' %}<|system|>\n{{ msg.content }}{%- endif %}{%- endfor %}"
    "{%- for message in messages if message.role != 'system' %}{%- set role = message['role'] %}"
    "{%- set content = message['content'] %}{%- set meta = message.get('metadata', '') %}"
    "{%- if role == 'user' %}<|user|>\n{{ content }}{%- elif role == 'assistant' and not meta %}<|assistant|>\n"
    "{{ content }}{%- elif role == 'assistant' and meta %}<|assistant|>{{ meta }} \n{{ content }}"
    "{%- elif role == 'observation' %}<|observation|>\n{{ content }}{%- endif %}{%- endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
GLM4_TOKENS = ("[gMASK]", "<sop>", "<|observation|>")


def glm4_model(model_dirs, out_dir: Path) -> Path:
    """The tiny glm4 model (GLM-4-0414's architecture) with its template's structure; it stops at
    <|user|> and <|observation|> (after a call) as at its EOS, as GLM-4-0414 does."""
    if out_dir.exists():
        return out_dir
    path = with_template(model_dirs("glm4", special=GLM4_TOKENS), out_dir, GLM4_0414)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    stops = [tok.token_to_id("<|end|>"), tok.token_to_id("<|user|>"), tok.token_to_id("<|observation|>")]
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((path / name).read_text())
        cfg["eos_token_id"] = stops
        (path / name).write_text(json.dumps(cfg))
    return path


HARMONY_TOKENS = ("<|start|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")

TEMPLATES = {"qwen": QWEN, "qwen3-coder": QWEN_XML, "glm-4.5": GLM45, "mistral": MISTRAL, "llama3.1": LLAMA31}


def harmony_model(model_dirs, out_dir: Path) -> Path:
    """The tiny gpt_oss model with harmony's special tokens and template; it stops at <|return|>
    and <|call|> (as gpt-oss does), while <|end|> only ends a message."""
    if out_dir.exists():
        return out_dir
    path = with_template(model_dirs("gpt_oss", special=HARMONY_TOKENS), out_dir, HARMONY)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    stops = [tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")]
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((path / name).read_text())
        cfg["eos_token_id"] = stops
        (path / name).write_text(json.dumps(cfg))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        cfg = json.loads((path / name).read_text())
        cfg["eos_token"] = "<|return|>"
        (path / name).write_text(json.dumps(cfg))
    return path


def with_template(model_dir: Path, out_dir: Path, template: str) -> Path:
    """A copy of a tiny model whose tokenizer carries `template`."""
    if out_dir.exists():
        return out_dir
    shutil.copytree(model_dir, out_dir)
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg))
    return out_dir
