"""Generate ``data/corpus.txt``: English-like text from a small hand-written grammar.

The demo needs a text corpus that ships inside the package, downloads nothing and
carries no third-party license, so it is synthesized here. The output is a pure
function of the seed, so rerunning this script reproduces the committed file:

    python -m lzero.demo.make_corpus
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

NAMES = ["Mira", "Tobin", "Ada", "Oskar", "Lena", "Pell", "Rhea", "Ivo", "Nessa", "Bram", "Juno", "Cato"]
PLACES = ["the mill", "the harbor", "the orchard", "the old bridge", "the market", "the hill road",
          "the lighthouse", "the bakery", "the river bank", "the library", "the forge", "the square"]
NOUNS = ["lantern", "basket", "letter", "boat", "map", "kettle", "fiddle", "ladder", "garden", "clock",
         "wagon", "net", "window", "bell", "coat", "barrel", "book", "rope", "loaf", "compass"]
ADJECTIVES = ["small", "heavy", "bright", "quiet", "old", "crooked", "warm", "painted", "broken",
              "green", "tall", "curious", "patient", "salty", "narrow", "golden", "careful", "tired"]
ADVERBS = ["slowly", "carefully", "at once", "without a word", "again", "before dawn", "gladly",
           "with some trouble", "in the rain", "after supper", "twice", "by lamplight"]
VERBS = [("carried", "carry"), ("mended", "mend"), ("found", "find"), ("painted", "paint"),
         ("sold", "sell"), ("borrowed", "borrow"), ("lost", "lose"), ("cleaned", "clean"),
         ("opened", "open"), ("counted", "count"), ("hid", "hide"), ("tied", "tie")]
MOTIONS = ["walked to", "ran toward", "rowed past", "waited near", "climbed up to", "wandered through"]
WEATHER = ["The wind came in from the sea", "Rain tapped on the roofs", "Fog sat low over the water",
           "The sun rose pale and cold", "Snow had fallen in the night", "The air smelled of smoke and salt"]
FEELINGS = ["pleased", "worried", "sleepy", "proud", "puzzled", "hungry", "cheerful", "uneasy"]
CONNECTIVES = ["Later,", "Meanwhile,", "After a while,", "By noon,", "That evening,", "Soon", "Then"]
REASONS = ["because the tide was turning", "because the market opened early", "so that nobody would worry",
           "since the roads were wet", "because a storm was coming", "so the children could see it"]


class Grammar:
    """Expands sentence templates with words drawn from one seeded generator."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def pick(self, words: list) -> object:
        return self.rng.choice(words)

    def thing(self) -> str:
        words = [self.pick(NOUNS)]
        if self.rng.random() < 0.5:
            words.insert(0, self.pick(ADJECTIVES))
        article = self.pick(["the", "a", "her", "his", "their"])
        if article == "a" and words[0][0] in "aeiou":
            article = "an"
        return " ".join([article, *words])

    def action(self) -> str:
        past, _ = self.pick(VERBS)
        clause = f"{self.pick(NAMES)} {past} {self.thing()}"
        if self.rng.random() < 0.4:
            clause += f" at {self.pick(PLACES)}"
        if self.rng.random() < 0.4:
            clause += f" {self.pick(ADVERBS)}"
        if self.rng.random() < 0.25:
            clause += f" {self.pick(REASONS)}"
        return clause

    def sentence(self) -> str:
        kind = self.rng.random()
        if kind < 0.35:
            text = self.action()
        elif kind < 0.5:
            text = f"{self.pick(NAMES)} {self.pick(MOTIONS)} {self.pick(PLACES)} and felt {self.pick(FEELINGS)}"
        elif kind < 0.6:
            text = self.pick(WEATHER)
        elif kind < 0.75:
            text = f"{self.pick(CONNECTIVES)} {self.action()}"
        elif kind < 0.85:
            text = f"{self.action()}, and {self.action()}"
        else:
            return self.dialogue()
        return text[0].upper() + text[1:] + "."

    def dialogue(self) -> str:
        speaker, listener = self.rng.sample(NAMES, 2)
        _, verb = self.pick(VERBS)
        line = self.pick([
            f"Can you {verb} {self.thing()} before evening?",
            f"I left {self.thing()} at {self.pick(PLACES)},",
            f"We should go to {self.pick(PLACES)} {self.pick(ADVERBS)},",
            f"Have you seen {self.thing()}?",
            f"I am too {self.pick(FEELINGS)} to {verb} anything today,",
        ])
        said = self.pick(["said", "asked", "called", "whispered", "answered"])
        return f'"{line}" {said} {speaker} to {listener}.'

    def paragraph(self) -> str:
        return " ".join(self.sentence() for _ in range(self.rng.randint(3, 7)))


def make_corpus(n_bytes: int, seed: int = 0) -> str:
    """Paragraphs separated by blank lines until the text holds at least ``n_bytes``."""
    grammar = Grammar(seed)
    paragraphs, size = [], 0
    while size < n_bytes:
        paragraphs.append(grammar.paragraph())
        size += len(paragraphs[-1]) + 2
    return "\n\n".join(paragraphs) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=200_000, help="approximate corpus size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data" / "corpus.txt")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(make_corpus(args.bytes, args.seed), encoding="ascii")
    print(f"wrote {args.out.stat().st_size} bytes to {args.out}")


if __name__ == "__main__":
    main()
