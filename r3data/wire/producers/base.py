"""What a producer format is: one producer's response body at one version, as a registry entry.

A :class:`ProducerFormat` says how to recognise its bodies (``r3data inspect``), how to decode
them into rows with positions (the loader, one :class:`ChoiceRows` per choice), and how to
synthesise them from what an engine computed (:class:`EngineRequest`; the demo, notebooks and
tests). Its options are a frozen dataclass (:class:`SourceOptions` and subclasses): a
misspelt option is a :class:`~r3data.errors.ConfigError` naming it and the valid ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar, Literal, NamedTuple

from r3data.errors import ConfigError
from r3data.options import unknown_names
from r3data.validate import checked_int, nonnegative_int
from r3data.wire.producers.common import (
    choice_token_lengths,
    is_stream,
    parse_plain,
    parse_response,
    placed_lengths,
    select_choices,
)
from r3data.wire.producers.request import NO_LENGTHS, EngineRequest, Lengths
from r3data.wire.rows import RowSource
from r3data.wire.segment import PayloadSegment

__all__ = [
    "MASK_FIELD",
    "NO_LENGTHS",
    "ROLES",
    "ROUTES_FIELD",
    "Choice",
    "ChoiceOptions",
    "ChoiceRows",
    "EngineRequest",
    "Lengths",
    "ProducerFormat",
    "Role",
    "ShapeOptions",
    "SourceOptions",
    "StartOptions",
    "option_names",
    "options_from",
]

ROUTES_FIELD = "routed_experts"
"""The field route rows go to (and the key every producer sends them under)."""
MASK_FIELD = "sampling_mask"
"""The field sampling masks go to: per completion token, the token ids the sampler kept."""

Role = Literal["full", "prefill", "decode"]
ROLES = ("full", "prefill", "decode")
"""What the instance that answered did under prefill/decode disaggregation: ``full`` (both),
``prefill`` (the prompt: its rows are the prompt's), ``decode`` (the completion: its rows at
prompt positions were never forwarded there and are never trusted, see
:class:`~r3data.trace.TraceBuilder`)."""


@dataclass(frozen=True, kw_only=True)
class SourceOptions:
    """Options every format takes: ``role`` (see :data:`ROLES`)."""

    role: Role = "full"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"role: expected one of {list(ROLES)}, found {self.role!r}")


@dataclass(frozen=True, kw_only=True)
class ChoiceOptions(SourceOptions):
    """``choice``: the index of the one choice (or batch item) to decode; None: every one."""

    choice: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.choice is not None:
            object.__setattr__(self, "choice", nonnegative_int("choice", self.choice))


@dataclass(frozen=True, kw_only=True)
class StartOptions(ChoiceOptions):
    """``start``: the request's prompt start (vLLM ``routed_experts_prompt_start``, SGLang
    ``routed_experts_start_len``): the first position the rows cover. No producer echoes it."""

    start: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "start", nonnegative_int("start", self.start))


@dataclass(frozen=True, kw_only=True)
class ShapeOptions(ChoiceOptions):
    """``num_layers`` and ``topk`` shape flat ids (SGLang sends no shape): the model config's
    ``num_hidden_layers`` and ``num_experts_per_tok``."""

    num_layers: int
    topk: int

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(
            self, "num_layers", checked_int("num_layers", self.num_layers, minimum=1)
        )
        object.__setattr__(self, "topk", checked_int("topk", self.topk, minimum=1))


_OPTIONS_CACHED = 4096
"""Options kept per format (sources of a run repeat a few combinations)."""


@cache
def option_names(options: type[SourceOptions]) -> frozenset[str]:
    """The names of an options class's fields."""
    return frozenset(f.name for f in dataclasses.fields(options))


def options_from(
    options: type[SourceOptions],
    values: Mapping[str, Any],
    *,
    what: str,
    skip: tuple[str, ...] = (),
) -> SourceOptions:
    """``options(**values)`` (keys in ``skip`` left out); an unknown key or a missing one is a
    :class:`ConfigError` naming it and the valid ones."""
    names = option_names(options)
    kwargs = {k: v for k, v in values.items() if k not in skip}
    unknown_names(f"{what} options", kwargs, names)
    missing = sorted(
        f.name
        for f in dataclasses.fields(options)
        if f.name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    )
    if missing:
        raise ConfigError(
            f"{what} options: missing {', '.join(map(repr, missing))}; valid options: "
            f"{', '.join(sorted(names))}"
        )
    return options(**kwargs)


@dataclass(frozen=True, slots=True)
class ChoiceRows:
    """The sources one choice (or batch item) of a response gave, by field and position;
    ``missing`` names the fields the producer sent as null (no rows)."""

    choice: int
    sources: tuple[RowSource | PayloadSegment, ...]
    missing: tuple[str, ...] = ()


class Choice(NamedTuple):
    """One choice (or batch item) of a parsed response and what the decode call was given:
    what :meth:`ProducerFormat.decode_choice` reads."""

    response: Any
    """The parsed response (a stream's assembled one)."""
    index: int
    entry: Any
    """The choice's object (SGLang's: the batch item)."""
    options: SourceOptions
    lengths: Lengths
    fields: frozenset[str] | None
    shared: Any = None
    """What :meth:`ProducerFormat.shared_rows` read from the response for every choice."""

    def wants(self, field: str) -> bool:
        """Whether the call asked for ``field`` (no fields named: every one)."""
        return self.fields is None or field in self.fields

    def placed(
        self, what: str, found: tuple[int | None, int | None] | None = None
    ) -> tuple[int | None, int | None]:
        """``(prompt_len, completion_len)``: the counts the body gives (``found``; default: the
        choice's token id lists) placed against the request's (:func:`~.common.placed_lengths`)."""
        if found is None:
            found = choice_token_lengths(self.response, self.entry)
        return placed_lengths(found, self.lengths, self.options.role, what)


class ProducerFormat:
    """One producer's response format at one version (range): a registry entry.

    Subclasses set the class attributes and implement :meth:`recognise`, :meth:`decode_choice`
    and :meth:`encode` (and set :attr:`stream_assembler` where the producer streams, implement
    :meth:`choices` where the body has no OpenAI-style ``choices`` list, :meth:`shared_rows`
    where the response holds rows for all its choices); their module exposes the instance as
    ``FORMAT``.
    """

    name: ClassVar[str]
    """The registry name, as loader sources and ``r3data inspect --producer`` say it."""
    producer: ClassVar[str]
    versions: ClassVar[str]
    """The producer versions (or commits) that send this format."""
    fields: ClassVar[tuple[str, ...]] = (ROUTES_FIELD,)
    """The fields its rows go to."""
    options: ClassVar[type[SourceOptions]] = ChoiceOptions
    spliced: ClassVar[tuple[str, ...]] = ()
    """The keys whose base64 blobs a raw body is spliced on (``load_packed_body``: the blobs
    never become strings); empty for a body parsed plainly (rows as JSON lists or strings)."""
    layer_axis: ClassVar[Literal["all", "moe"]] = "all"
    """Route rows hold every decoder layer (dense ones zero) or only the MoE layers."""
    prompt_start: ClassVar[bool] = True
    """The engine honours a request's prompt start (rows from it); else rows from 0."""
    current: ClassVar[bool] = True
    """The format the producer's current release sends (else an older one)."""
    stream_assembler: ClassVar[Callable[[Any, str], Any] | None] = None
    """Where the producer streams: ``(raw, what)`` -> the one response a raw server-sent-event
    body assembles to (``what`` names the stream in errors); set as a ``staticmethod``. None:
    a stream body is parsed as any other (and refused)."""

    def make_options(self, values: Mapping[str, Any], skip: tuple[str, ...] = ()) -> SourceOptions:
        """This format's options from ``values`` (keys in ``skip`` left out); the same values
        give the same (immutable) options, checked once."""
        given: dict[str, Any] = {}
        key: tuple[tuple[str, type, Any], ...] = ()  # True == 1, but not here
        for k, v in values.items():
            if k not in skip:
                given[k] = v
                key += ((k, type(v), v),)
        cache = self.__dict__.setdefault("_options_cache", {})
        try:
            return cache[key]
        except KeyError:
            pass
        except TypeError:  # an unhashable value: checked each time
            return options_from(self.options, given, what=f"producer {self.name!r}")
        if len(cache) >= _OPTIONS_CACHED:
            cache.clear()
        made = cache[key] = options_from(self.options, given, what=f"producer {self.name!r}")
        return made

    def parse(self, response: Any) -> Any:
        """``response`` (a raw body or a parsed one) as a document: a stream's as
        :attr:`stream_assembler` assembles it, else spliced on :attr:`spliced` (blobs left
        encoded), or parsed plainly where that is empty."""
        if self.stream_assembler is not None and is_stream(response):
            return self.stream_assembler(response, f"{self.name} stream")
        if self.spliced:
            return parse_response(response, self.spliced)
        return parse_plain(response, f"{self.name} response")

    def rows_meta(
        self, choice: Choice, prompt_len: int | None, completion_len: int | None
    ) -> dict[str, Any]:
        """What the format says about a choice's rows: its name, the choice's index, the
        lengths, the role and which layers the layer axis holds (:attr:`layer_axis`)."""
        return {
            "producer": self.name,
            "choice": choice.index,
            "prompt_len": prompt_len,
            "completion_len": completion_len,
            "role": choice.options.role,
            "layer_axis": self.layer_axis,
        }

    def recognise(self, doc: Any) -> bool:
        """Whether ``doc`` (a parsed body, or a :class:`~.common.Stream` of parsed events) is
        one of this format's bodies."""
        raise NotImplementedError

    def decode(
        self,
        response: Any,
        options: SourceOptions,
        lengths: Lengths = NO_LENGTHS,
        fields: frozenset[str] | None = None,
    ) -> list[ChoiceRows]:
        """The rows of each choice (or of ``options.choice``) of ``response`` (a raw body or a
        parsed one), for ``fields`` (default: every field the format has). ``lengths`` are
        the request's, used where the body does not carry them and checked where it does."""
        parsed = self.parse(response)
        chosen = self.choices(parsed, options)
        shared = self.shared_rows(parsed)
        return [
            self.decode_choice(Choice(parsed, index, entry, options, lengths, fields, shared))
            for index, entry in chosen
        ]

    def choices(self, parsed: Any, options: ChoiceOptions) -> list[tuple[int, Any]]:
        """``[(index, choice), ...]`` to decode: of the OpenAI-style ``choices`` list (all, or
        ``options.choice``)."""
        return select_choices(parsed, options.choice, f"{self.name} response")

    def shared_rows(self, parsed: Any) -> Any:
        """Rows the response holds for all its choices, read once (None: the format has none)."""
        return None

    def decode_choice(self, choice: Choice) -> ChoiceRows:
        """The rows of one choice."""
        raise NotImplementedError

    def encode(self, request: EngineRequest) -> bytes:
        """The body this producer sends for ``request``."""
        raise NotImplementedError

    def start_of(self, options: SourceOptions) -> int:
        """Where a request's rows start: the request's prompt start where the format takes one
        (``options.start``), else 0."""
        return options.start if isinstance(options, StartOptions) else 0

    def check_start(self, request: EngineRequest) -> None:
        """A format whose engine has no prompt start serves every row from position 0."""
        if request.start and not self.prompt_start:
            raise ConfigError(
                f"producer {self.name!r} returns rows from position 0 (its engine has no "
                f"prompt start): serve every row, found start {request.start}"
            )

    def request_options(self, request: EngineRequest) -> dict[str, Any]:
        """The options a client knows for ``request`` (its start, the model's shape), for a
        loader source of :meth:`encode`'s body."""
        names = option_names(self.options)
        known = {
            "start": request.start,
            "num_layers": request.routes.shape[1],
            "topk": request.routes.shape[2],
        }
        return {name: value for name, value in known.items() if name in names}

    def __repr__(self) -> str:
        return f"<producer format {self.name!r}: {self.producer} {self.versions}>"
