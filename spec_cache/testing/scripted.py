"""A "scripted" tiny model for tests and demos: greedy decoding follows a fixed script of whole-string tokens.

Why: a tiny random model never writes a tool call by chance, so the tool-call paths of the servers could only be
tested with canned text. This model is real (an mlx-lm llama directory, loaded and served like any other), and
its weights make greedy decoding deterministic:

* the tokenizer is a WordLevel vocabulary of SentencePiece-style pieces (``▁`` stands for the space before a word;
  decoded as Llama 2's tokenizer decodes, so llguidance reads every token's bytes and grammars work) whose added
  tokens are whole strings: ``<tool_call>``, the call's JSON with a space either side
  (`` {"name": "get_weather", "arguments": {"city": "Paris"}} ``), ``</tool_call>``, ``<tool_response>``, the JSON
  answer as ``{`` and ``"city": "Paris"}``, the chat markers ``<|im_start|>`` / ``<|im_end|>`` (the EOS), and a few
  words;
* one layer whose only non-zero parts are an attention value / output pair: every position attends uniformly to
  the positions before it and writes the share of ``<tool_response>`` tokens among them into a spare "flag"
  dimension of the residual stream (the MLP and the queries / keys are zero);
* embeddings are one-hot and the head maps each token to its successor in ``script`` with a large logit (so
  ``<tool_call>`` -> call JSON -> ``</tool_call>`` -> EOS); the generation prompt's last token (``assistant``)
  starts ``script`` with a small logit, which the flag overrides: once a tool result is in the context the
  model answers with ``reply`` (``It is sunny in Paris.``) instead of calling the tool again. The JSON answer's
  ``{`` follows the start token with a weaker logit still, so it is what a grammar that refuses ``<tool_call>``
  (``response_format`` json_object / json_schema with a string ``city``) leaves the greedy row (llguidance forces
  the ``{`` and tokenizes it with this tokenizer: it must be a token of its own), then ``"city": "Paris"}``, then
  EOS.

So: a first turn with tools gets a tool call; the turn that sends the tool result back gets a plain answer; a
request for JSON gets ``{"city": "Paris"}``.
``template="hermes"``: a chat template with Hermes/Qwen-style tool support (tools in the system turn, assistant
calls as ``<tool_call> {json} </tool_call>``, results as ``<tool_response>`` user turns); ``"plain"``: a
template without tool support (``spec_cache.apps.server.tools`` then uses its fallback).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import numpy as np

__all__ = ["ANSWER_JSON", "CALL", "REPLY", "HERMES_TEMPLATE", "PLAIN_TEMPLATE", "write_scripted_model"]

#: the tool call the script emits (one token) and the reply once a tool result is in the context
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
REPLY = ("It", "is", "sunny", "in", "Paris.")
#: what the model writes where a grammar refuses the tool call (two tokens: ``{``, the rest)
ANSWER_JSON = '{"city": "Paris"}'
_OPEN, _JSON_REST = "{", ANSWER_JSON[1:]
START, EOS, MARKER = "assistant", "<|im_end|>", "<tool_response>"
#: the space before a word, as SentencePiece writes it; a lone space between added tokens is this piece alone
SPACE = "\u2581"
#: the words that open a turn, right after ``<|im_start|>`` (no space before them)
_ROLES = ("system", "user", "assistant", "tool")
_SPECIAL = ("<|im_start|>", EOS)
_ADDED = ("<tool_call>", "</tool_call>", MARKER, "</tool_response>", "<tools>", "</tools>", _OPEN, _JSON_REST)
_WORDS = ("What", "is", "the", "weather", "in", "Paris?", "Hello", "Thanks")

#: logits: a script step, the start token's script (weak: the flag overrides it), the flag's pull per unit share,
#: the start token's JSON answer (weaker than the script: chosen only where a grammar masks the script)
_CHAIN, _WEAK, _FLAG, _JSON = 1e6, 1.0, 1e4, 0.5

HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system {% if messages[0].role == 'system' %}{{ messages[0].content }} {% endif %}"
    "<tools>{% for tool in tools %} {{ tool | tojson }}{% endfor %} </tools><|im_end|>"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system {{ messages[0].content }}<|im_end|>{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}<|im_start|>user {{ message.content }}<|im_end|>"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant{% if message.content %} {{ message.content }}"
    "{% endif %}{% for call in message.tool_calls or [] %} <tool_call> {\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}} </tool_call>{% endfor %}<|im_end|>"
    "{%- elif message.role == 'tool' %}<|im_start|>user <tool_response> {{ message.content }} </tool_response>"
    "<|im_end|>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant{% endif %}"
)

PLAIN_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }} {{ message.content }}<|im_end|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant{% endif %}"
)


def _vocabulary(call: str, reply: Sequence[str]) -> list[str]:
    """Special tokens, added tokens (the call token spaced), the role words, then the words as pieces (``▁word``)
    and the lone space."""
    vocab = ["<unk>", *_SPECIAL, *_ADDED, _call_token(call), *_ROLES]
    for word in (*_WORDS, *reply, ""):
        if SPACE + word not in vocab:
            vocab.append(SPACE + word)
    return vocab


def _call_token(call: str) -> str:
    """The call as one token, with the spaces the templates put around it (``<tool_call> {json} </tool_call>``)."""
    return f" {call} "


def write_scripted_model(path: str | Path, *, template: str = "hermes", call: str = CALL,
                         reply: Sequence[str] = REPLY) -> Path:
    """Write the scripted model (config, weights, tokenizer) to ``path``; returns the path. ``call``: the one
    token written between ``<tool_call>`` and ``</tool_call>``; ``reply``: the words answered after a tool
    result (distinct from each other and from the script's tokens)."""
    from spec_cache.testing.tiny import write_tiny_target

    templates = {"hermes": HERMES_TEMPLATE, "plain": PLAIN_TEMPLATE}
    if template not in templates:
        raise ValueError(f"unknown scripted template {template!r}; known: {', '.join(templates)}")
    vocab = _vocabulary(call, reply)
    index = {token: i for i, token in enumerate(vocab)}
    script = ["<tool_call>", _call_token(call), "</tool_call>", EOS]
    if len(set(reply)) != len(reply) or set(reply) & {"<tool_call>", call, "</tool_call>", EOS} or START in reply:
        raise ValueError("reply words must be distinct and not part of the tool-call script")
    hidden = 64 if len(vocab) < 64 else 128
    path = Path(path)
    write_tiny_target(path, "llama", hidden_size=hidden, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=hidden,
                      intermediate_size=64, vocab_size=len(vocab), tokenizer=False)
    weights = {name: mx.zeros_like(value) for name, value in mx.load(str(path / "model.safetensors")).items()}
    flag = hidden - 1
    embed = np.zeros((len(vocab), hidden), np.float32)
    embed[np.arange(len(vocab)), np.arange(len(vocab))] = 1.0
    weights["model.embed_tokens.weight"] = mx.array(embed)
    for name in ("model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
                 "model.norm.weight"):
        weights[name] = mx.ones((hidden,))
    value = np.zeros((hidden, hidden), np.float32)
    value[0, index[MARKER]] = 1.0  # the value of a position: whether it is a tool result's marker
    weights["model.layers.0.self_attn.v_proj.weight"] = mx.array(value)
    output = np.zeros((hidden, hidden), np.float32)
    output[flag, 0] = hidden**-0.5  # the flag: the share of markers so far (undoing the input norm's sqrt(d))
    weights["model.layers.0.self_attn.o_proj.weight"] = mx.array(output)
    head = np.zeros((len(vocab), hidden), np.float32)
    successor = {token: EOS for token in vocab}
    successor.update(zip(script, script[1:]))
    pieces = [SPACE + word for word in reply]
    successor.update(zip(pieces, [*pieces[1:], EOS]))
    successor[_OPEN], successor[_JSON_REST] = _JSON_REST, EOS
    for token, following in successor.items():
        if token != START:
            head[index[following], index[token]] = _CHAIN
    head[index[script[0]], index[START]] = _WEAK
    head[index[_OPEN], index[START]] = _JSON
    head[index[pieces[0]], flag] = _FLAG
    weights["lm_head.weight"] = mx.array(head)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config.update(bos_token_id=index["<|im_start|>"], eos_token_id=index[EOS])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _write_tokenizer(path, vocab, templates[template])
    return path


def _write_tokenizer(path: Path, vocab: list[str], template: str) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    # "user What is" -> user ▁What ▁is; a word right after a special or added token (a role) has no ▁
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="never")
    # Llama 2's decoder (mlx-lm streams it with its SentencePiece detokenizer; llguidance reads its bytes)
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIAL])
    whole = [t for t in vocab[1:] if t not in _SPECIAL and (t in _ADDED or " " in t)]
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in whole])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<|im_start|>",
                                      eos_token=EOS, clean_up_tokenization_spaces=False)
    wrapped.save_pretrained(str(path))
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config, indent=2) + "\n")
