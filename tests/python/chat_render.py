"""Renders a chat request as transformers does and tokenises it with a word-level vocabulary.

The reference side of tests/engine_hash_vectors.rs' chat vectors, written from transformers'
documented chat-template environment (Jinja2's sandbox with trim_blocks and lstrip_blocks, a
raise_exception global, the messages / add_generation_prompt / bos_token / eos_token names)
and from the Hugging Face WordLevel model with the Whitespace pre-tokeniser (special tokens
matched first, then the pieces \\w+ and [^\\w\\s]+). No kvpool code.

stdin: one JSON object {"template", "messages", "add_generation_prompt", "bos_token",
"eos_token", "vocab": {word: id}, "unk": word, "special": [word, ...]}.
stdout: {"text": rendered prompt, "tokens": [ids]}.
"""

import json
import re
import sys

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


def raise_exception(message):
    raise TemplateError(message)


def render(req):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(req["template"])
    return template.render(
        messages=req["messages"],
        add_generation_prompt=req.get("add_generation_prompt", True),
        bos_token=req.get("bos_token", ""),
        eos_token=req.get("eos_token", ""),
    )


def tokenise(text, vocab, unk, special):
    ids = []
    if special:
        pattern = "(" + "|".join(re.escape(s) for s in special) + ")"
        pieces = re.split(pattern, text)
    else:
        pieces = [text]
    for piece in pieces:
        if piece in special:
            ids.append(vocab[piece])
            continue
        for word in re.findall(r"\w+|[^\w\s]+", piece):
            ids.append(vocab.get(word, vocab[unk]))
    return ids


def main():
    req = json.loads(sys.stdin.read())
    text = render(req)
    tokens = tokenise(text, req["vocab"], req["unk"], req.get("special", []))
    print(json.dumps({"text": text, "tokens": tokens}))


if __name__ == "__main__":
    main()
