"""A small GPT and byte-level text data for demonstrating and benchmarking lzero."""

from lzero.demo.data import TextDataModule
from lzero.demo.model import GPT, GPTConfig
from lzero.demo.module import DemoGPT

__all__ = ["GPT", "GPTConfig", "DemoGPT", "TextDataModule"]
