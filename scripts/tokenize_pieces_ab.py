"""A long chat prompt's handling: its tokenization whole and in pieces at once
(kvshare.models.text_pieces), and a replica's reading of it as JSON and as the router packs it.

python3 scripts/tokenize_pieces_ab.py [--tokens 131072] [--repeats 5] [--json FILE]

Builds a user message of about --tokens tokens of English (words of this repository's README
in a seeded random order), renders it with SmolLM2's chat template and times, alternated:
the template; the two encodes of the rendered text, `tokenizers`' own on the whole text
(what a replica and the router each did per chat request before) and kvshare's
`Tokenizer.encode` (pieces at once, one per core); and a replica's handling of the request
body up to its checked prompt ids (`parse_generate`), from the JSON a client sends and from
the packed body the router sends with the ids it made (kvshare.serve.packed_request); and
the next turn of that chat (a short answer and question more) encoded by a tokenizer that
kept the first turn's ids (kvshare.models.encoded_prefixes), against encoding it whole; and
a Chinese text of as many characters (no spaces: cut at its punctuation), whole and in
pieces. Checks first that every way gives the same ids.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvshare.models.encoded_prefixes import EncodedPrefixes
from kvshare.models.loader import load_tokenizer
from kvshare.models.text_pieces import piece_count
from kvshare.serve.http import parse_json_object
from kvshare.serve.packed_request import pack_request, unpack_request
from kvshare.serve.protocol import ModelInfo, parse_generate

README = Path(__file__).resolve().parent.parent / "README.md"


CHINESE = "长文本的分词测试，你好世界！这是一个很长的句子，用来测量切分后的速度。"


def message_of(tokens: int, seed: int) -> str:
    words = README.read_text().split()
    rng = random.Random(seed)
    return " ".join(rng.choice(words) for _ in range(tokens // 2))  # ~2 tokens a word here


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    tokenizer = load_tokenizer("smollm2-135m")
    assert tokenizer is not None
    messages = [{"role": "user", "content": message_of(args.tokens, args.seed)}]
    text = tokenizer.apply_chat_template(messages)
    whole_ids = tokenizer.backend.encode(text, add_special_tokens=False).ids
    if tokenizer.encode(text) != whole_ids:
        raise SystemExit("the pieces' ids differ from the whole's")
    model = ModelInfo("m", tokenizer, 2 * len(whole_ids), tokenizer.vocab_size, "float32")
    body = {"model": "m", "messages": messages, "max_tokens": 1}
    raw = json.dumps(body).encode()
    packed = pack_request(body, whole_ids, tokenizer.digest)
    assert packed is not None
    for read in (parse_json_object(raw), unpack_request(packed)):
        if parse_generate(read, True, model).prompt_token_ids.tolist() != whole_ids:
            raise SystemExit("the replica's ids differ from the whole's")
    turn2 = [*messages, {"role": "assistant", "content": "It says little."}]
    turn2.append({"role": "user", "content": "Then what does it ask of the reader?"})
    text2 = tokenizer.apply_chat_template(turn2)

    def first_turn(read: dict[str, object]) -> object:
        """The replica's handling of a chat none of whose text it kept."""
        assert tokenizer is not None
        tokenizer.prefixes = EncodedPrefixes()
        return parse_generate(read, True, model)

    def next_turn() -> tuple[list[int], float]:
        """The next turn's ids and ms, with only the first turn kept (as in a session)."""
        assert tokenizer is not None
        tokenizer.prefixes = EncodedPrefixes()
        tokenizer.encode(text, scope="")
        start = time.perf_counter()
        ids = tokenizer.encode(text2, scope="")
        return ids, (time.perf_counter() - start) * 1e3

    if next_turn()[0] != tokenizer.backend.encode(text2, add_special_tokens=False).ids:
        raise SystemExit("the next turn's ids differ from its whole text's")
    chinese = (CHINESE * (len(text) // len(CHINESE) + 1))[: len(text)]
    if tokenizer.encode(chinese) != tokenizer.backend.encode(chinese).ids:
        raise SystemExit("the Chinese text's pieces give other ids than its whole")
    timings: dict[str, list[float]] = {
        name: []
        for name in (
            "template",
            "whole",
            "pieces",
            "replica json",
            "replica packed",
            "next turn, whole",
            "next turn, kept",
            "chinese, whole",
            "chinese, pieces",
        )
    }
    runs = {
        "template": lambda: tokenizer.apply_chat_template(messages),
        "whole": lambda: tokenizer.backend.encode(text, add_special_tokens=False),
        "pieces": lambda: tokenizer.encode(text),
        "replica json": lambda: first_turn(parse_json_object(raw)),
        "replica packed": lambda: parse_generate(unpack_request(packed), True, model),
        "next turn, whole": lambda: tokenizer.backend.encode(text2, add_special_tokens=False),
        "chinese, whole": lambda: tokenizer.backend.encode(chinese, add_special_tokens=False),
        "chinese, pieces": lambda: tokenizer.encode(chinese),
    }
    for _ in range(args.repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            timings[name].append((time.perf_counter() - start) * 1e3)
        timings["next turn, kept"].append(next_turn()[1])
    medians = {name: statistics.median(ms) for name, ms in timings.items()}
    result = {
        "tokens": len(whole_ids),
        "chars": len(text),
        "cores": len(os.sched_getaffinity(0)),
        "pieces": piece_count(len(text)),
        "ms": timings,
        "median_ms": medians,
        "pieces_over_whole": medians["pieces"] / medians["whole"],
        "chinese_tokens": len(tokenizer.backend.encode(chinese).ids),
    }
    table = Table(title=f"{len(whole_ids):,} tokens, {result['cores']} cores")
    for column in ("step", "median ms", "runs ms", "/ its text whole"):
        table.add_column(column)
    for name, ms in timings.items():
        whole = next((f"{t}, whole" for t in ("next turn", "chinese") if name.startswith(t)), "")
        table.add_row(
            name,
            f"{medians[name]:.1f}",
            ", ".join(f"{m:.1f}" for m in ms),
            f"{medians[name] / medians[whole or 'whole']:.2f}",
        )
    Console().print(table)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
