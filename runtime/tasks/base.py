"""The task base: what an artifact is for, over the engine(s) that run it.

A task is one class per kind of artifact (text embedding, classification, generation, ...),
chosen once at load by :mod:`slimml.runtime.tasks.registry`. Every task has the engine's API
(``run``, ``verify``, ``check_files``, ``plan``, ``stats``, ``close``) and the documented task
API (``encode``, ``classify``, ``generate``, ...). What it can do is declared, not guessed:
``methods`` lists its own methods, ``supports(name)`` asks, and a method it lacks raises
:class:`~slimml.errors.TaskError` naming the artifact's task and the method that would work.

An artifact of one chain of shards has one engine (``task.engine``); an artifact of several
components (CLIP's towers, an encoder and a decoder) has one engine per component
(``task.parts[name]``), each with its own execution plan.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from slimml.errors import FeedError, SlimmlError, TaskError
from slimml.runtime.artifact.files import safe_path
from slimml.runtime.artifact.manifest import Manifest, tensor_list
from slimml.runtime.tasks.inputs.image import ImageProcessor
from slimml.runtime.tasks.inputs.text import TextEncoder, listed, prompt_text
from slimml.runtime.tasks.limits import Limits, a_or_an, shown

if TYPE_CHECKING:
    from slimml.runtime.engine.engine import Engine

# The documented task API: the call each method stands for in a message, and what kind of
# model it needs (for "it is a 'generic' model, not a sentence-embedding model").
CALLS = {
    "encode": "encode(texts)", "encode_with_counts": "encode_with_counts(texts)", "embed_texts": "embed_texts(texts)",
    "tokenize": "tokenize(texts)", "count_tokens": "count_tokens(texts)", "classify": "classify(inputs)",
    "embed_images": "embed_images(images)", "preprocess": "preprocess(images)", "generate": "generate(prompts)",
    "stream": "stream(prompt)", "chat": "chat(messages)", "rerank": "rerank(query, documents)",
    "rerank_with_counts": "rerank_with_counts(query, documents)", "entities": "entities(texts)",
    "answer": "answer(question, context)", "perplexity": "perplexity(text)",
}
NEEDS = {
    "encode": "a sentence-embedding model", "encode_with_counts": "a sentence-embedding model",
    "embed_texts": "an image-text model (CLIP)", "tokenize": "a model with a tokenizer",
    "count_tokens": "a model with a tokenizer", "classify": "a classifier", "embed_images": "an image-embedding model",
    "preprocess": "a model that takes images", "generate": "a text-generation model",
    "stream": "a decoder (text-generation) model", "chat": "a decoder (text-generation) model",
    "rerank": "a cross-encoder (a text classifier with one output)",
    "rerank_with_counts": "a cross-encoder (a text classifier with one output)",
    "entities": "a token classifier (named entities)", "answer": "an extractive question-answering model",
    "perplexity": "a language model (text-generation)",
}

_DECODER = ("text-generation", "text-generation-with-past")
# the manifest tasks whose models have each method: one that loaded without it has a graph not of its task
DECLARED = {"generate": _DECODER, "stream": _DECODER, "chat": _DECODER, "perplexity": _DECODER,
            "answer": ("question-answering",), "entities": ("token-classification",),
            "classify": ("text-classification", "image-classification")}


class Task:
    """A loaded artifact: its engine(s) and what it is for. Made by :func:`slimml.runtime.load`.

    Attributes:
        kind: the task's registered name ("sentence-embedding", "text-generation", ...).
        methods: the task API methods this artifact has (``supports(name)``); ``run`` always.
        accepts: the raw inputs it takes besides arrays: "text", "images", "audio".
        engine: the :class:`~slimml.runtime.engine.engine.Engine` of a one-chain artifact (None
            for an artifact of components).
        parts: component name -> its engine (empty for a one-chain artifact).
        text: the tokenizer (a :class:`~slimml.runtime.tasks.inputs.text.TextEncoder`) or None.
    """

    kind: ClassVar[str] = "generic"
    methods: ClassVar[frozenset[str]] = frozenset()
    suggest: ClassVar[tuple[str, ...]] = ()  # the methods an error points to first: the task's main ones

    def __init__(self, folder: Path, manifest: Manifest, engines: Mapping[str | None, Engine]):
        if not engines:
            raise SlimmlError(f"the artifact {folder} loaded no chain of shards; convert it again.")
        self.folder = Path(folder)
        self.manifest = manifest
        self.engine: Engine | None = engines.get(None)
        self.parts: dict[str, Engine] = {k: v for k, v in engines.items() if k is not None}
        self.device = next(iter(engines.values())).device
        self.limits = Limits()  # what one call may ask (texts' characters, generate's tokens): raise for trusted input
        self.text: TextEncoder | None = None
        self.images: ImageProcessor | None = None
        self.image_input: str | None = None  # the pixel input's name, where the chain takes images
        if self.engine is not None:  # one chain: its own tokenizer and image preprocessor
            self.text = text_encoder(self.folder, manifest, self.limits)
            self.image_input, self.images = image_input(self.folder, manifest)

    # -- what it can do ------------------------------------------------------------------------

    def supports(self, name: str) -> bool:
        """Whether ``name`` (a task API method, or ``run``) works on this artifact."""
        return name == "run" or name in self.capabilities

    @property
    def capabilities(self) -> frozenset[str]:
        """``methods``, with ``tokenize``/``count_tokens`` where a tokenizer was shipped and
        ``preprocess`` where images are taken."""
        extra = {"tokenize", "count_tokens"} if self.text is not None else set()
        if self.image_input is not None:
            extra.add("preprocess")
        return type(self).methods | extra

    @property
    def accepts(self) -> frozenset[str]:
        """Raw inputs this artifact takes (beyond arrays for ``run``)."""
        return frozenset(k for k, v in (("text", self.text), ("images", self.image_input)) if v is not None)

    def unsupported(self, method: str) -> TaskError:
        """The :class:`TaskError` for calling ``method``, which this artifact's task lacks."""
        alternatives = tuple(m for m in self.suggest if self.supports(m)) + ("run",)
        use = ", ".join(CALLS[m] for m in alternatives[:-1])
        use = f"{use}, or run() for its raw outputs" if use else "run() for its raw outputs"
        declared = self.manifest.task in DECLARED.get(method, ())  # the manifest's task has it: its graph is not that task's
        if method in ("tokenize", "count_tokens"):
            why = "has no tokenizer, so it cannot take text"
        elif method == "preprocess":
            why = "does not take images"
        elif declared:
            m = self.manifest
            why = (f"cannot {method}(): its manifest says task {m.task!r}, but its graph takes "
                   f"{tensor_list(m.inputs, False) or 'nothing'} and gives {tensor_list(m.outputs, False) or 'nothing'}, "
                   f"which is not such a model, so it loaded as a {self.kind!r} model"
                   + (" (tensors in, tensors out)" if self.kind == "generic" else ""))
            use = f"{use}, or re-convert it from its source (slimml convert SOURCE --task {m.task})"
        else:
            why = f"cannot {method}(): it is {a_or_an(repr(self.manifest.task))} model, not {NEEDS.get(method, 'one that has it')}"
        if self.manifest.stage_of not in ("", "generic"):  # load(shards=...) cut a stage of a model that has it
            why = (f"cannot {method}() on a stage: load(shards=...) loads a span of shards, which runs tensors, "
                   f"not its {self.manifest.stage_of!r} model")
            use = f"load(folder) without shards= to {method}(), or {use}"
        if method in ("encode", "encode_with_counts") and self.manifest.task == "feature-extraction":  # a plain encoder
            use += ("; for sentence embeddings, save the source as sentence-transformers does "
                    "(SentenceTransformer(FOLDER).save(OUT): mean pooling) and convert OUT")
        task = self.kind if declared else self.manifest.task  # what it loaded as, where they differ
        return TaskError(f"the artifact {self.folder} {why}; use {use}.", task, method, alternatives)

    # -- the task API: each raises TaskError unless the task has it ------------------------------

    def encode(self, texts: list[str], batch_size: int = 32, show_progress: bool = False,
               workers: int | None = None, *, prompt_name: str | None = None, prompt: str | None = None,
               truncate_dim: int | None = None) -> np.ndarray:
        """Sentence embeddings (sentence-embedding artifacts, CLIP's text tower)."""
        raise self.unsupported("encode")

    def encode_with_counts(self, texts: list[str], batch_size: int = 32, show_progress: bool = False,
                           workers: int | None = None, *, prompt_name: str | None = None,
                           prompt: str | None = None, truncate_dim: int | None = None) -> tuple[np.ndarray, list[int]]:
        """:meth:`encode` and the tokens of each text (sentence-embedding artifacts)."""
        raise self.unsupported("encode_with_counts")

    def text_prompt(self, prompt_name: str | None = None, prompt: str | None = None) -> str:
        """The text :meth:`encode` puts before each text: ``prompt``, else the model's prompt named
        ``prompt_name`` (sentence-transformers' prompts, ``"query"``), else its default prompt."""
        return prompt_text(self.manifest.pooling, prompt_name, prompt)

    def embed_texts(self, texts: list[str], batch_size: int = 32, show_progress: bool = False) -> np.ndarray:
        """Text embeddings of an image-text model (CLIP)."""
        raise self.unsupported("embed_texts")

    def classify(self, inputs: Any, top_k: int | None = 5, batch_size: int = 32, **kwargs) -> list[list[dict]]:
        """Labels and scores (classifiers; CLIP with ``labels=``)."""
        raise self.unsupported("classify")

    def rerank(self, query: str, documents: list[str] | None = None, top_n: int | None = None,
               batch_size: int = 32) -> list[dict]:
        """Documents ranked by relevance to a query (cross-encoders)."""
        raise self.unsupported("rerank")

    def rerank_with_counts(self, query: str, documents: list[str] | None = None, top_n: int | None = None,
                           batch_size: int = 32) -> tuple[list[dict], list[int]]:
        """:meth:`rerank` and the tokens of each (query, document) pair (cross-encoders)."""
        raise self.unsupported("rerank_with_counts")

    def entities(self, texts: list[str], aggregation: str = "simple", **kwargs) -> list[list[dict]]:
        """Labelled spans of each text (token classifiers: named entities)."""
        raise self.unsupported("entities")

    def answer(self, question: Any, context: Any = None, top_k: int = 1, **kwargs) -> Any:
        """The span of a context that answers a question (extractive question answering)."""
        raise self.unsupported("answer")

    def perplexity(self, text: str, window: int | None = None, max_tokens: int | None = None) -> Any:
        """How well a language model predicts a text (text-generation artifacts)."""
        raise self.unsupported("perplexity")

    def embed_images(self, images: Any, batch_size: int = 32, normalize: bool = True) -> np.ndarray:
        """Image embeddings (image-embedding artifacts, CLIP's vision tower)."""
        raise self.unsupported("embed_images")

    def generate(self, prompts: Any, max_new_tokens: int = 32, **kwargs):
        """Continue prompts (decoders, encoder-decoders)."""
        raise self.unsupported("generate")

    def stream(self, prompt: Any, config: Any = None, **options):
        """One prompt's continuation as text pieces (decoders)."""
        raise self.unsupported("stream")

    def chat(self, messages: Any, config: Any = None, stream: bool = False, **options):
        """The reply to ``messages`` through the model's chat template (decoders)."""
        raise self.unsupported("chat")

    def tokenize(self, texts: list[str], pad_to: int | None = None) -> dict[str, np.ndarray]:
        """Feeds for ``texts`` (or ``(text, text)`` pairs) from the artifact's tokenizer, padded to
        the longest (or ``pad_to``).

        Args:
            texts: a list of texts, or of ``(text, text)`` pairs (each pair read as one input, as a
                cross-encoder reads a query and a passage).
            pad_to: pad every row to at least this many tokens (default: the longest row's).

        Returns:
            The model's text inputs by name (``input_ids``, ``attention_mask``, and
            ``token_type_ids`` or ``position_ids`` where the model takes them), each
            (len(texts), tokens) int64, right-padded; each text cut to the tokenizer's maximum
            length. Ready for :meth:`run`.

        Raises:
            TaskError: the artifact ships no tokenizer.
            FeedError: not a list of texts, an empty list, or a text that is not valid Unicode.

        Example:
            >>> model = load("artifacts/all-MiniLM-L6-v2")
            >>> model.tokenize(["Hello world", "Hi"])["input_ids"].tolist()
            [[101, 7592, 2088, 102], [101, 7632, 102, 0]]
        """
        texts = listed(texts)
        check_unicode(texts)
        if self.text is None:
            raise self.unsupported("tokenize")
        return self.text(texts, pad_to=pad_to)

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Tokens per text as the model sees them (after truncation to its maximum length).

        Args:
            texts: a list of texts (or of ``(text, text)`` pairs).

        Returns:
            One count a text, special tokens included.

        Raises:
            TaskError: the artifact ships no tokenizer.
            FeedError: an empty list, or an item that is not a text.

        Example:
            >>> model.count_tokens(["Hello world", "Hi"])
            [4, 3]
        """
        texts = listed(texts)
        check_unicode(texts)
        if self.text is None:
            raise self.unsupported("count_tokens")
        return [len(e.ids) for e in self.text.encodings(texts)]

    def preprocess(self, images: Any) -> dict[str, np.ndarray]:
        """Feeds for ``images`` (the pixel input), made as the source's Hugging Face image processor makes them.

        Args:
            images: an image or a list of them: file paths, PIL images or HxWx3 uint8 arrays
                (reading them needs the ``vision`` extra, Pillow).

        Returns:
            ``{pixel input name: (len(images), 3, H, W) float32}``, ready for :meth:`run`.

        Raises:
            TaskError: the artifact does not take images.
            SlimmlError: it ships no image preprocessor (``preprocessor_config.json``).
            FeedError: no image, or one that cannot be read.
        """
        if self.image_input is None:
            raise self.unsupported("preprocess")
        return next(self.image_batches(images if isinstance(images, (list, tuple)) else [images], 1 << 30))

    def image_batches(self, images: Any, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        """``{pixel input: (B, 3, H, W)}`` per ``batch_size`` images, through the shipped image preprocessor."""
        if self.images is None:
            raise SlimmlError(
                f"the artifact {self.folder} has no image preprocessor (preprocessor_config.json), so it cannot take "
                "images: convert from a folder that has one (save the model's image processor there), or call run() "
                "with pixel_values."
            )
        if not isinstance(images, (list, tuple)):
            images = [images]
        if not images:
            raise FeedError("give at least one image.")
        size = check_batch(batch_size)
        for i in range(0, len(images), size):
            yield {self.image_input: self.images(list(images[i:i + size]))}

    # -- the engine(s) ----------------------------------------------------------------------------

    def run(self, feeds: Mapping[str, np.ndarray], component: str | None = None) -> dict[str, np.ndarray]:
        """Run the artifact on ``feeds`` (input name -> array); return its outputs by name.

        For an artifact of components: ``component`` runs that one; without it, every
        component whose inputs the feeds hold runs.

        Args:
            feeds: input name -> numpy array, one for each of ``model.inputs`` (:meth:`tokenize`
                makes them from texts, :meth:`preprocess` from images).
            component: for an artifact of components, the one to run (a key of ``parts``).

        Returns:
            Output name -> numpy array: every output of the model, or of the components run.

        Raises:
            FeedError: feeds that do not fit the inputs (names, dtypes, shapes, values).
            SlimmlError: ``component`` given for a one-chain artifact, or one it does not have.

        Example:
            >>> model = load("artifacts/all-MiniLM-L6-v2")
            >>> model.run(model.tokenize(["Hello world"]))["last_hidden_state"].shape
            (1, 4, 384)
        """
        if self.engine is not None:
            if component is not None:
                raise SlimmlError(f"the artifact {self.folder} is one chain of shards, without components; "
                                  "call run(feeds) without component=.")
            return self.engine.run(feeds)
        if component is not None:
            return self.part(component).run(feeds)
        if not isinstance(feeds, Mapping):
            raise FeedError(f"run() takes a dict of input name -> array, got {type(feeds).__name__}.")
        chosen = [n for n, p in self.parts.items() if {t.name for t in p.inputs} <= set(feeds)]
        taken = {t.name for n in chosen for t in self.parts[n].inputs}
        unused = sorted(set(feeds) - taken)
        if not chosen or unused:
            wants = "; ".join(f"{n}: {', '.join(t.name for t in p.inputs)}" for n, p in self.parts.items())
            raise FeedError(
                f"the feeds {sorted(feeds)} are not the inputs of this artifact's components ({wants}); "
                "give every input of the components to run, or run(feeds, component=NAME)."
            )
        out: dict[str, np.ndarray] = {}
        for name in chosen:
            out |= self.parts[name].run({k: feeds[k] for k in (t.name for t in self.parts[name].inputs)})
        return out

    def part(self, name: str) -> Engine:
        """The engine of component ``name`` (its own ``run``, ``plan`` and ``stats``).

        Raises:
            SlimmlError: the artifact has no component of that name (the message lists those it has).
        """
        if name not in self.parts:
            has = f"it has {', '.join(self.parts)}" if self.parts else "it is one chain of shards"
            raise SlimmlError(f"the artifact {self.folder} has no component {name!r}; {has}.")
        return self.parts[name]

    @property
    def _engines(self) -> list[Engine]:
        return [self.engine] if self.engine is not None else list(self.parts.values())

    @property
    def inputs(self):
        """The model's inputs, a list of :class:`~slimml.runtime.artifact.manifest.TensorSpec` (name, dtype, shape)."""
        return self.manifest.inputs

    @property
    def outputs(self):
        """The model's outputs, a list of :class:`~slimml.runtime.artifact.manifest.TensorSpec`."""
        return self.manifest.outputs

    @property
    def plan(self):
        """The execution plan (``plan.describe()``); for components, each one's, described together."""
        return self.engine.plan if self.engine is not None else Plans({n: p.plan for n, p in self.parts.items()})

    @property
    def stats(self):
        """Streaming counters (per component for an artifact of components)."""
        return self.engine.stats if self.engine is not None else {n: p.stats for n, p in self.parts.items()}

    @property
    def threads(self) -> int | None:
        """ONNX Runtime intra-op threads, as ``load(threads=)`` or ``SLIMML_THREADS`` set them (None: ORT's choice)."""
        return self._engines[0].threads

    @property
    def max_sequence_length(self) -> int | None:
        """The most tokens the model takes in one sequence (:meth:`run`'s bound): its position table's
        rows, else the smaller of the tokenizer's ``max_length`` and the source's
        ``max_position_embeddings`` (None: no bound known). A text task may cut texts shorter: a
        sentence embedder's ``max_seq_length`` is what ``encode`` keeps."""
        return next((e.max_sequence_length for e in self._engines if e.max_sequence_length), None)

    @property
    def vocab_size(self) -> int | None:
        """Rows of the token table ``input_ids`` index (a larger id is refused); None where the graph has none."""
        return next((e.vocab_size for e in self._engines if e.vocab_size), None)

    @property
    def owns_files(self) -> bool:
        return all(e.owns_files for e in self._engines)

    @property
    def allow_nonfinite(self) -> bool:
        """NaN/inf in float inputs raise FeedError unless set (activations of pipeline stages)."""
        return all(e.allow_nonfinite for e in self._engines)

    @allow_nonfinite.setter
    def allow_nonfinite(self, value: bool) -> None:
        for e in self._engines:
            e.allow_nonfinite = value

    def lane(self, threads: int):
        """``run`` on a single-threaded copy of the plan: see :meth:`Engine.lane`."""
        if self.engine is None:
            raise SlimmlError(f"the artifact {self.folder} has components; lanes are per component: "
                              "task.part(NAME).lane(threads).")
        return self.engine.lane(threads)

    def verify(self) -> None:
        """Re-hash every file of the artifact against the manifest, as ``load`` did.

        Raises:
            IntegrityError: naming the file that no longer matches.
        """
        for e in self._engines:
            e.verify()

    @property
    def replaced(self) -> bool:
        """Whether another artifact took this one's path since load (its files renamed over, or the
        folder swapped): the loaded model still runs, from the files it holds."""
        return any(e.replaced for e in self._engines)

    def check_files(self) -> None:
        """Has any file changed since load? (cheap: see :meth:`Engine.check_files`).

        Raises:
            IntegrityError: naming a file replaced, truncated or removed since load.
        """
        for e in self._engines:
            e.check_files()

    def close(self) -> None:
        """Stop loader threads and drop every session; a later call raises SlimmlError ("the model was closed")."""
        for e in self._engines:
            e.close()

    def __enter__(self):
        """``with load(path) as model:``: closed when the block ends."""
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __reduce_ex__(self, protocol):
        # pickling, copying and a spawned worker's arguments all come here: sessions, threads and file
        # watches cannot travel (a shallow copy would share them: closing it closed the original)
        raise SlimmlError(f"a loaded model cannot be pickled or copied; pass the artifact's path ({self.folder}) and "
                          "call slimml.runtime.load() in the worker, or share this one object between threads.")

    def __getattr__(self, name: str):
        # the one engine's other attributes (its file watch, its lanes) read through
        engine = self.__dict__.get("engine")
        if engine is not None and not name.startswith("__") and (hasattr(type(engine), name) or name in vars(engine)):
            return getattr(engine, name)  # the engine's own (an AttributeError inside one of its properties stays its own)
        manifest = self.__dict__.get("manifest")
        if name.startswith("_") or manifest is None:  # (no attribute read here: one still unset would come back here)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        hint = PEER_METHODS.get(name) or "its methods: " + ", ".join(f"{m}()" for m in sorted(type(self).methods | {"run"}))
        raise AttributeError(f"{type(self).__name__} ({a_or_an(repr(manifest.task))} artifact) has no attribute {name!r}; {hint}.")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.kind} {self.folder}>"


# other libraries' methods a user may reach for, and what to call here instead
PEER_METHODS = {
    "similarity": "cosine similarity of encode's rows: a = model.encode(x); a /= np.linalg.norm(a, axis=1, keepdims=True); a @ a.T",
    "get_sentence_embedding_dimension": "model.encode(['x']).shape[1] is the embedding's size",
    "encode_query": "encode(texts, prompt_name='query') puts the model's query prompt first",
    "encode_document": "encode(texts) (prompt_name='document' where the model has that prompt)",
    "create_chat_completion": "chat(messages) replies, as OpenAI's messages list gives them",
    "create_completion": "generate(prompt) continues a text",
    "detokenize": "model.text.tokenizer.decode(ids) turns ids back into text",
    "decode": "model.text.tokenizer.decode(ids) turns ids back into text",
    "predict": "classify(texts) for labels and scores, rerank(query, documents) for a cross-encoder",
}


class Plans:
    """Each component's execution plan: ``plans[name]``; ``streaming`` if any of them streams."""

    def __init__(self, plans: dict):
        self.plans = plans

    def __getitem__(self, name: str):
        return self.plans[name]

    @property
    def streaming(self) -> bool:
        return any(p.streaming for p in self.plans.values())

    def describe(self) -> str:
        """Each component's plan, described as ``ExecutionPlan.describe`` does, one after the other."""
        return "\n".join(f"component {name}: {p.describe()}" for name, p in self.plans.items())


def text_encoder(folder: Path, manifest: Manifest, limits: Limits | None = None) -> TextEncoder | None:
    """The tokenizer a chain's inputs take, or None when it ships none."""
    if not manifest.tokenizer:
        return None
    return TextEncoder(safe_path(folder, manifest.tokenizer["file"]), manifest.tokenizer, [t.name for t in manifest.inputs],
                       limits)


def image_input(folder: Path, manifest: Manifest) -> tuple[str | None, ImageProcessor | None]:
    """``(pixel input name, image processor)`` of a chain: the input is None when it takes no
    images, the processor None when no image preprocessor config was shipped."""
    name = next((t.name for t in manifest.inputs if t.name == "pixel_values"
                 or (len(t.shape) == 4 and not t.name.startswith("past_key_values"))), None)  # a KV cache is 4-D too
    pre = manifest.preprocessor
    if name is None or not pre or pre.get("kind") != "image":
        return name, None
    return name, ImageProcessor.from_file(safe_path(folder, pre["file"]))


def check_batch(batch_size: Any) -> int:
    """``batch_size``, or FeedError when it is not a whole number >= 1."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise FeedError(f"batch_size must be a whole number >= 1, got {shown(batch_size)}.")
    return batch_size


def check_unicode(texts: Any) -> None:
    """Raise FeedError for a text (or a text of a pair) that is not valid Unicode (a lone surrogate)."""
    for i, t in enumerate(texts if isinstance(texts, (list, tuple)) else []):
        try:
            for x in (t if isinstance(t, (list, tuple)) else (t,)):
                isinstance(x, str) and x.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate, e.g. from a bad decode upstream
            raise FeedError(
                f"text {i} is not valid Unicode ({e.reason} at position {e.start}); decode your input with "
                "errors='replace' or clean it first."
            ) from None


_TASKS: dict[str, type[Task]] = {}


def register_task(kind: str):
    """Class decorator: ``@register_task("sentence-embedding")`` makes the class the task for
    artifacts of that kind (:func:`slimml.runtime.tasks.registry.kind_of` says which kind an
    artifact is). Adding a task adds a class, not an ``if`` in the server or the CLI."""

    def add(cls: type[Task]) -> type[Task]:
        cls.kind = kind
        _TASKS[kind] = cls
        return cls

    return add


def task_class(kind: str) -> type[Task]:
    """The class registered for ``kind``."""
    try:
        return _TASKS[kind]
    except KeyError:
        raise SlimmlError(f"no task is registered for {kind!r}; known: {', '.join(sorted(_TASKS))}.") from None
