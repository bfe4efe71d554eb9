"""`POST /v1/chat/completions`: messages rendered with the model's chat template, then served
as one session like any completion (so it checkpoints, restores and migrates the same way; the
chat id is the session id).

The template is `chat_template.jinja` or `tokenizer_config.json`'s `chat_template`, rendered as
transformers' `apply_chat_template` does: a sandboxed jinja2 environment with `trim_blocks` and
`lstrip_blocks`, loop controls, the `{% generation %}` tag, `raise_exception`, `strftime_now`, a
`tojson` that keeps non-ASCII, the special tokens (`bos_token`, `eos_token`, ...) as variables,
and `add_generation_prompt=True`; the text is tokenized without adding special tokens (the
template places them).
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from fastapi import APIRouter, Depends, Request
from jinja2.sandbox import ImmutableSandboxedEnvironment
from relayout.engine.api.openai_request import OpenAIRequest
from relayout.engine.api.served import Served, served
from relayout.engine.api.streaming import (
    CompletionShape,
    Shape,
    StopTextStream,
    StreamSpec,
    admit,
    collect,
    migrated_message,
    session_events,
    streaming_response,
    usage,
)
from relayout.engine.model.tokenizer import Tokenizer
from relayout.engine.runtime.async_engine import EngineDeadError
from relayout.engine.runtime.engine import RequestError
from relayout.engine.runtime.logprobs import MAX_TOP_LOGPROBS, LogprobRecord, chat_logprobs
from relayout.engine.runtime.session import SamplingParams
from relayout.engine.web import error_response

ROLES = ("system", "user", "assistant")


# ---- the template ----------------------------------------------------------------------------------
class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore-prefixed attributes (no reach into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} may not start with '_'")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = _Namespace
    return env


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]):
        self.source = source
        self.special_tokens = special_tokens
        try:
            self.compiled: jinja2.Template | None = _environment().from_string(source)
            self.error = ""
        except jinja2.TemplateError as e:  # every request then says why
            self.compiled, self.error = None, f"the model's chat template does not compile: {e}"

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self.compiled is None:
            raise RequestError(self.error)
        try:
            return self.compiled.render(messages=messages, tools=None, documents=None,
                                        add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.TemplateError as e:
            raise RequestError(f"the chat template failed to render: {e}") from None


def _token_string(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):  # a serialized AddedToken
        return v["content"]
    return None


def load_chat_template(model_dir: Path) -> ChatTemplate | None:
    """The model directory's chat template (`chat_template.jinja` first, as transformers saves it
    now, else `tokenizer_config.json`'s `chat_template`: a string, or a list of named templates
    of which "default" is taken); None if it has none."""
    model_dir = Path(model_dir)
    conf: dict[str, Any] = {}
    if (model_dir / "tokenizer_config.json").is_file():
        conf = json.loads((model_dir / "tokenizer_config.json").read_text())
    specials = {"bos_token": "", "eos_token": ""}
    specials.update({k: s for k, v in conf.items() if k.endswith("_token") and (s := _token_string(v)) is not None})
    source = conf.get("chat_template")
    if (model_dir / "chat_template.jinja").is_file():
        source = (model_dir / "chat_template.jinja").read_text()
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    return ChatTemplate(source, specials) if isinstance(source, str) else None


# ---- the request -------------------------------------------------------------------------------------
class ChatCompletionRequest(OpenAIRequest):
    messages: list[Any]
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # extension (vLLM's)

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the template sees them; a list of text parts becomes its joined text."""
        if not self.messages:
            raise RequestError("messages must not be empty")
        out = []
        for i, m in enumerate(self.messages):
            if not isinstance(m, dict):
                raise RequestError(f"messages[{i}] must be an object with a role and a content")
            role = m.get("role")
            if role not in ROLES:
                raise RequestError(f"messages[{i}].role: unknown role {role!r} (one of {', '.join(ROLES)})")
            msg = {"role": role, "content": _content_text(m.get("content"), i)}
            if isinstance(m.get("name"), str):
                msg["name"] = m["name"]
            out.append(msg)
        return out

    def sampling(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        if self.n not in (None, 1):
            raise RequestError("n must be 1")
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise RequestError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.top_logprobs}")
            if not self.logprobs:
                raise RequestError("top_logprobs needs logprobs set to true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        # unset: what is left of the context (the engine refuses a prompt that fills it)
        return self.sampling_params(max_tokens, max(1, max_model_len - prompt_len),
                                    (self.top_logprobs or 0) if self.logprobs else None)


def _content_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)  # OpenAI's text parts, joined as vLLM does
    raise RequestError(f"messages[{i}].content must be a string or a list of text parts "
                       f"({{\"type\": \"text\", \"text\": ...}})")


# ---- the response shapes -------------------------------------------------------------------------------
class ChatShape:
    """Chat chunks: a first chunk with the role, then content deltas, then the finish reason."""

    object = "chat.completion.chunk"

    def __init__(self, tok: Tokenizer, logprobs: bool):
        self.tok, self.logprobs = tok, logprobs

    def opening(self) -> dict | None:
        return {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def skip(self, ids: list[int]) -> None:
        pass  # chat logprobs carry no offsets

    def choice(self, text: str, ids: list[int], records: list[LogprobRecord] | None,
               finish: str | None) -> dict:
        lp = chat_logprobs(self.tok, ids, records) if self.logprobs and records else None
        delta = {"content": text} if text or finish is None else {}
        return {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}


def shape_for(spec: StreamSpec, tok: Tokenizer) -> Shape:
    """How a session's stream is shaped, by the API it came from."""
    if spec.api == "chat":
        return ChatShape(tok, spec.logprobs is not None)
    return CompletionShape(tok, spec.logprobs is not None)


# ---- the route -----------------------------------------------------------------------------------------
router = APIRouter()  # the replica's chat completions (engine.api.server.create_app includes it)


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request, sv: Served = Depends(served)):
    aengine, model_name, tok, template = sv.aengine, sv.model_name, sv.tok, sv.chat_template
    if not aengine.healthy:
        raise EngineDeadError(str(aengine.dead_error()))
    if template is None:
        raise RequestError(f"model {model_name} has no chat template (chat_template in tokenizer_config.json)")
    text = template.render(req.template_messages(), req.add_generation_prompt)
    ids = tok.encode(text, add_special_tokens=False)
    params = req.sampling(len(ids), sv.max_model_len)
    include_usage = bool(req.stream and (req.stream_options or {}).get("include_usage"))
    s = await admit(aengine, ids, params, "chat", include_usage, session_id=f"chatcmpl-{uuid.uuid4().hex}")
    sid, created = s.session_id, int(time.time())
    shape = ChatShape(tok, params.logprobs is not None)
    if req.stream:
        return streaming_response(session_events(
            aengine, request, sid, model=model_name, created=created, shape=shape, spec=StreamSpec.of(s),
            from_token=0, with_ids=req.return_token_ids, prompt_len=len(ids)))
    out, records, snap = await collect(aengine, request, sid)
    if snap.get("state") == "migrated":
        return error_response(409, migrated_message(sid), "session_migrated")
    ts = StopTextStream(tok, params.stop)
    choice: dict[str, Any] = {
        "index": 0, "message": {"role": "assistant", "content": ts.add(out) + ts.finish()},
        "logprobs": chat_logprobs(tok, out, records) if params.logprobs is not None else None,
        "finish_reason": snap.get("finish_reason"),
    }
    if req.return_token_ids:
        choice["token_ids"] = out
    return {"id": sid, "object": "chat.completion", "created": created, "model": model_name,
            "choices": [choice], "usage": usage(len(ids), len(out))}
