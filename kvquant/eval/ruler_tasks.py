"""RULER's synthetic tasks (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?"), generated offline and written afresh from the paper's definitions.

Each generator is a pure function of (subtask, length, index, seed, tokenizer): the same arguments
give the same prompt ids and answers. Prompts are assembled in token space, like ``passkey``, so
they fill their budget exactly: RULER counts the generation in the length, so a prompt holds
``length - tokens_to_generate`` tokens. Haystacks: ``noise`` (a fixed block of sentences, repeated),
``needle`` (distractor needles with other keys), ``essay`` (bundled WikiText-2 or TinyStories text
instead of the Paul Graham essays RULER downloads, split at sentence ends). Needles go in between
haystack units at depths drawn from RULER's 40 evenly spaced depths; the first asked needle's depth
and token position are recorded per example. The prompt wording is ours, with RULER's meaning.
"""

from __future__ import annotations

import random
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvquant.errors import InvalidParameterError
from kvquant.eval.engine import bos_prefix

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
DEPTHS = [round(i / 39, 4) for i in range(40)]  # RULER's depths: 0 … 100% in 40 even steps
ADJECTIVES = (
    "able agile amber ancient bitter bold brave bright brisk calm clever cold cosmic crisp curious dark "
    "eager early fancy fierce gentle giant golden grand happy hidden humble icy jolly kind lively lucky "
    "mellow merry misty noble odd pale plain proud quiet rapid rare rough royal rusty silent silver "
    "sleepy smooth solid sunny swift tidy vivid warm wild wise witty young"
).split()
NOUNS = (
    "anchor apple arrow badger banjo barrel beacon bison blanket bottle bridge bucket camel candle "
    "canyon castle cedar comet copper cotton crater dolphin engine falcon feather fiddle forest garden "
    "glacier harbor helmet island jacket kettle ladder lantern lemon magnet marble meadow mirror "
    "needle orchard otter parrot pebble pepper piano pillow planet pocket puzzle rabbit ribbon "
    "saddle shovel spider tiger tunnel turnip violin wagon walnut whistle window"
).split()
# RULER's generation budgets (tokens) per task family: the prompt gets the rest of the length
TOKENS_TO_GENERATE = {"niah": 128, "vt": 30, "fwe": 50}


@dataclass(frozen=True)
class Niah:
    """A needle-in-a-haystack variant: haystack kind, key and value kinds, and needle counts."""

    haystack: str  # noise | needle | essay
    keys: str = "words"  # words | numbers | uuids
    values: str = "numbers"
    num_k: int = 1
    num_v: int = 1
    num_q: int = 1


SUBTASKS: dict[str, Niah | str] = {
    "niah_single_1": Niah("noise"),
    "niah_single_2": Niah("essay"),
    "niah_single_3": Niah("essay", values="uuids"),
    "niah_multikey_1": Niah("essay", num_k=4),
    "niah_multikey_2": Niah("needle"),
    "niah_multikey_3": Niah("needle", keys="uuids", values="uuids"),
    "niah_multivalue": Niah("essay", num_v=4),
    "niah_multiquery": Niah("essay", num_k=4, num_q=4),
    "vt": "vt",
    "fwe": "fwe",
}


@dataclass
class Example:
    """One prompt (token ids) and what a correct answer must contain."""

    subtask: str
    length: int
    index: int
    ids: list[int]
    answers: list[str]
    query: str
    depth: float | None = None  # where the first asked needle (vt: the value's assignment) sits, 0…1
    needle_pos: int | None = None  # its first token in ``ids``
    needle: str | None = None  # its text
    distractors: list[str] = field(default_factory=list)  # keys of needles not asked about


def family(subtask: str) -> str:
    return "niah" if subtask.startswith("niah") else subtask


def tokens_to_generate(subtask: str) -> int:
    return TOKENS_TO_GENERATE[family(subtask)]


def string_match_all(output: str, answers: Sequence[str]) -> float:
    """RULER's score for niah, vt and fwe: the share of the answers found in the output (any case)."""
    text = "".join("\n" if ord(c) < 32 else c for c in output).strip().lower()
    return sum(a.lower() in text for a in answers) / len(answers)


def _random(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))  # RULER's 7-digit values
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def _clash(a: str, others: Sequence[str]) -> bool:
    return any(a in b or b in a for b in others)


def _place(units: list[list[int]], inserts: list[tuple[float, list[int]]]) -> tuple[list[int], list[int]]:
    """``units`` joined, each insert at the unit boundary nearest ``depth`` of the units' tokens (in the
    given order); returns the ids and where each insert starts."""
    offsets = [0]
    for unit in units:
        offsets.append(offsets[-1] + len(unit))
    slots: dict[int, list[int]] = {}
    for i, (depth, _) in enumerate(inserts):
        nearest = min(range(len(offsets)), key=lambda u: abs(offsets[u] - depth * offsets[-1]))
        slots.setdefault(nearest, []).append(i)
    ids: list[int] = []
    starts = [0] * len(inserts)
    for u in range(len(units) + 1):
        for i in slots.get(u, []):
            starts[i] = len(ids)
            ids += inserts[i][1]
        if u < len(units):
            ids += units[u]
    return ids, starts


def _fill(
    budget: int, unit: Callable[[int], list[int]], inserts: list[tuple[float, list[int]]], what: str
) -> tuple[list[int], list[int], int]:
    """Whole units until ``budget`` (inserts included), inserts placed among them, then the next unit
    cut to fill the budget exactly. Returns ids, insert starts and the number of whole units."""
    room = budget - sum(len(ids) for _, ids in inserts)
    if room < 0:
        raise InvalidParameterError(f"task ruler: length too short for {what}; choose larger task.lengths")
    units: list[list[int]] = []
    used = 0
    while used + len(nxt := unit(len(units))) <= room:
        units.append(nxt)
        used += len(nxt)
    ids, starts = _place(units, inserts)
    return ids + nxt[: room - used], starts, len(units)


def _essay_units(haystack: list[int], tokenizer, size: int, rng: random.Random) -> list[list[int]]:
    """A window of ``size`` tokens of the bundled text, split after tokens that end a sentence."""
    if len(haystack) < size:
        haystack = haystack * (size // max(1, len(haystack)) + 1)
    start = rng.randrange(0, len(haystack) - size + 1)
    window = haystack[start : start + size]
    units, last = [], 0
    for i, tok in enumerate(tokenizer.convert_ids_to_tokens(window)):
        if str(tok).endswith("."):
            units.append(window[last : i + 1])
            last = i + 1
    return units + ([window[last:]] if last < len(window) else [])


def niah(spec: Niah, name: str, length: int, index: int, seed: int, tokenizer, haystack: list[int]) -> Example:
    """RULER's needle in a haystack: needles ``One special magic <value kind> for <key> is: <value>.``
    at sampled depths; asked for the values of ``num_q`` keys (answers: all their values)."""
    rng = random.Random(f"ruler/{seed}/{name}/{length}/{index}")
    enc = _encoder(tokenizer)
    kind = spec.values.rstrip("s")
    keys: list[str] = []
    while len(keys) < max(spec.num_k, spec.num_q):
        key = _random(spec.keys, rng)
        if not _clash(key, keys):
            keys.append(key)
    values = [[_random(spec.values, rng) for _ in range(spec.num_v)] for _ in keys]
    needles = [
        (k, v, f"One special magic {kind} for {k} is: {v}.\n") for k, vs in zip(keys, values, strict=True) for v in vs
    ]
    rng.shuffle(needles)
    depths = sorted(rng.sample(DEPTHS, len(needles)))
    asked = rng.sample(range(len(keys)), spec.num_q)
    queries = [keys[i] for i in asked]
    answers = [v for i in asked for v in values[i]]
    query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
    one = spec.num_q * spec.num_v == 1
    noun, verb = (f"magic {kind}", "is") if one else (f"magic {kind}s", "are")
    it = "it" if one else "them"
    head = f"{'A' if one else 'Some'} special {noun} {verb} hidden in the text below. "
    head += f"Memorize {it}: I will ask you for {it} afterwards.\n"
    tail = f"\nWhat {verb} the special {noun} for {query} given in the text above? "
    tail += f"The special {noun} for {query} given in the text above {verb}"
    prefix = bos_prefix(tokenizer) + enc(head)
    budget = length - tokens_to_generate(name) - len(prefix) - len(enc(tail))
    inserts = [(d, enc(text)) for d, (_, _, text) in zip(depths, needles, strict=True)]
    distractors: list[str] = []
    if spec.haystack == "essay":
        room = budget - sum(len(ids) for _, ids in inserts)
        if room < 0:
            raise InvalidParameterError(f"task ruler: length {length} too short for {name}; choose larger task.lengths")
        units = _essay_units(haystack, tokenizer, room, rng)
        context, starts = _place(units, inserts)
    elif spec.haystack == "noise":
        noise = enc(NOISE)
        context, starts, _ = _fill(budget, lambda _: noise, inserts, f"{name} at length {length}")
    else:  # distractor needles: other keys, other values, from a stream of their own
        stream = random.Random(f"ruler/{seed}/{name}/{length}/{index}/distractors")

        def distractor(_: int) -> list[int]:
            key, value = keys[0], answers[0]
            while _clash(key, keys) or value in answers:  # never the asked key (nor one containing it)
                key, value = _random(spec.keys, stream), _random(spec.values, stream)
            distractors.append(key)  # the last one is cut to fill the length
            return enc(f"One special magic {kind} for {key} is: {value}.\n")

        context, starts, _ = _fill(budget, distractor, inserts, f"{name} at length {length}")
    first = next(i for i, (k, _, _) in enumerate(needles) if k == queries[0])
    ids = prefix + context + enc(tail)
    return Example(name, length, index, ids, answers, query, depths[first], len(prefix) + starts[first],
                   needles[first][2], distractors)  # fmt: skip


def _vt_prompt(rng: random.Random, enc, budget: int, hops: int, what: str, answer: bool) -> tuple:
    """One variable-tracking prompt of ``budget`` tokens: a chain of ``hops`` + 1 variables in noise."""
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}\n"] + [f"VAR {b} = VAR {a}\n" for a, b in zip(names, names[1:], strict=False)]
    depths = sorted(rng.sample(DEPTHS, len(chain)))
    head = enc("Memorize and follow the chain(s) of variable assignments hidden in the text below.\n\n")
    tail = enc(
        f"\nQuestion: Which variables are assigned the value {value} in the text above? Answer: Following "
        f"the chain(s) of assignments in the text above, {hops + 1} variables are assigned the value "
        f"{value}, they are:" + (" " + " ".join(names) + "\n" if answer else "")
    )
    noise = enc(NOISE)
    inserts = [(d, enc(s)) for d, s in zip(depths, chain, strict=True)]
    room = budget - len(head) - len(tail)
    if answer:  # the one-shot example: its chain at least, with no noise if its budget is smaller
        room = max(room, sum(len(ids) for _, ids in inserts))
    context, starts, _ = _fill(room, lambda _: noise, inserts, what)
    return head + context + tail, names, value, depths[0], len(head) + starts[0], chain[0]


def vt(name: str, length: int, index: int, seed: int, tokenizer, hops: int = 4) -> Example:
    """RULER's variable tracking: one chain of ``hops`` assignments hidden in noise, after a one-shot
    example (RULER's is ~500 tokens; ours is a quarter of the length up to 500, so short lengths fit,
    and never less than its chain)."""
    rng = random.Random(f"ruler/{seed}/{name}/{length}/{index}")
    enc = _encoder(tokenizer)
    bos = bos_prefix(tokenizer)
    what = f"vt at length {length}"
    shot = _vt_prompt(rng, enc, min(500, length // 4), hops, what, answer=True)[0]
    budget = length - tokens_to_generate(name) - len(bos) - len(shot)
    ids, names, value, depth, pos, needle = _vt_prompt(rng, enc, budget, hops, what, answer=False)
    offset = len(bos) + len(shot)
    return Example(name, length, index, bos + shot + ids, names, value, depth, offset + pos, needle)


def zipf_counts(n_words: int, vocab: int, alpha: float = 2.0) -> list[int]:
    """How often each of ``vocab`` ranked words occurs among ``n_words``: ``n·k^-α/ζ(α)``, floored."""
    zeta = sum(k**-alpha for k in range(1, 100_000)) + 100_000 ** (1 - alpha) / (alpha - 1)
    return [int(n_words * k**-alpha / zeta) for k in range(1, vocab + 1)]


def fwe(name: str, length: int, index: int, seed: int, tokenizer, alpha: float = 2.0) -> Example:
    """RULER's frequent-words extraction: coded words drawn with Zipf(α) counts, the most frequent one
    replaced by dots (noise); the answer is the next three. Words fill the prompt, dots pad it exactly."""
    rng = random.Random(f"ruler/{seed}/{name}/{length}/{index}")
    enc = _encoder(tokenizer)
    budget = length - tokens_to_generate(name)
    vocab: list[str] = ["...."]
    while len(vocab) < max(5, budget // 50):  # RULER: a vocabulary of one word per 50 tokens
        word = "".join(rng.choices(string.ascii_lowercase, k=6))
        if word not in vocab:
            vocab.append(word)
    prefix = bos_prefix(tokenizer) + enc(
        "Read the coded text below and count how often each coded word appears. Find the three most frequent coded words."  # noqa: E501
    )
    tail = enc(
        "\nQuestion: Give no explanation and ignore the dots '....'. Which three words appear most often in the "
        "coded text above? Answer: The three most frequent words in the coded text above are:"
    )
    room = budget - len(prefix) - len(tail)
    sizes = [len(enc(" " + w)) for w in vocab]

    def tokens(n_words: int) -> int:
        return sum(c * s for c, s in zip(zipf_counts(n_words, len(vocab), alpha), sizes, strict=True))

    lo, hi = 0, max(0, room)  # the most words whose tokens fit the room
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if tokens(mid) <= room else (lo, mid - 1)
    counts = zipf_counts(lo, len(vocab), alpha)
    if room < 0 or not counts[3] > counts[4]:
        raise InvalidParameterError(f"task ruler: length {length} too short for fwe; choose larger task.lengths")
    words = [w for w, c in zip(vocab, counts, strict=True) for _ in range(c)]
    rng.shuffle(words)
    context = [t for w in words for t in enc(" " + w)]
    dots = enc(" ....")
    context += (dots * (room // len(dots) + 1))[: room - len(context)]
    return Example(name, length, index, prefix + context + tail, vocab[1:4], "")


def haystack_ids(tokenizer, source: str) -> list[int]:
    """The bundled essay haystack's ids (``wikitext`` or ``tinystories``), encoded once per tokenizer."""
    from kvquant.data import corpus_ids

    return corpus_ids(tokenizer, source)


def generate(subtask: str, length: int, index: int, seed: int, tokenizer, haystack: str = "wikitext") -> Example:
    """Example ``index`` of ``subtask`` at ``length`` tokens (prompt plus RULER's generation budget)."""
    spec = SUBTASKS.get(subtask)
    if spec is None:
        raise InvalidParameterError(f"task ruler: unknown subtask '{subtask}'; valid subtasks: {', '.join(SUBTASKS)}")
    if spec == "vt":
        return vt(subtask, length, index, seed, tokenizer)
    if spec == "fwe":
        return fwe(subtask, length, index, seed, tokenizer)
    ids = haystack_ids(tokenizer, haystack) if spec.haystack == "essay" else []
    return niah(spec, subtask, length, index, seed, tokenizer, ids)


def _encoder(tokenizer) -> Callable[[str], list[int]]:
    return lambda text: tokenizer(text, add_special_tokens=False).input_ids
