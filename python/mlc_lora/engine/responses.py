"""The one builder of OpenAI response objects (protocol.py) from a request's step outputs, used
by MLCEngine, AsyncMLCEngine and the HTTP server alike."""

from __future__ import annotations

import time
import uuid
from typing import Optional

from ..tokenizer import Tokenizer
from . import protocol as P
from .core import StepOutput
from .sampler import Sampled
from .scheduler import Sequence


class ResponseBuilder:  # pylint: disable=too-many-instance-attributes
    """One request's OpenAI objects: choice i comes from the outputs of seqs[i].

    Streaming: `chunk(i, out)` for each output as it arrives (the usage, prompt counted once and
    every choice's tokens, rides on the chunk that finishes the last choice). Whole: `response(outs)`."""

    def __init__(self, chat: bool, model: str, tokenizer: Optional[Tokenizer], seqs: list[Sequence],
                 echo: Optional[list[str]] = None, n: Optional[int] = None):
        """`echo`: completions echo each choice's prompt text (and its logprobs when asked);
        `n`: choices per prompt (seqs[k*n:(k+1)*n] share prompt k; default: one prompt)."""
        self.chat, self.model, self.tokenizer, self.seqs = chat, model, tokenizer, seqs
        n = n or len(seqs)
        self.echo, self.n = echo, n
        self.prompt_tokens = sum(len(s.prompt_ids) for s in seqs[::n])
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self._first, self._offset = [True] * len(seqs), [0] * len(seqs)
        self._done, self._completion = 0, 0

    def _name(self, i: int) -> str:
        return self.tokenizer.token_text(i) if self.tokenizer is not None else str(i)

    def _top_dict(self, top) -> dict[str, float]:
        """Completions' top_logprobs entry: token text -> logprob. Distinct ids with the same text
        (partial UTF-8 bytes) keep the best logprob (the list is best first)."""
        out: dict[str, float] = {}
        for i, lp in top or []:
            out.setdefault(self._name(i), lp)
        return out

    def _prompt_logprobs(self, seq: Sequence, prompt: list[Sampled]) -> P.CompletionLogprobs:
        """The echoed prompt's logprobs: the first token has none (OpenAI's null); each top dict
        holds the prompt's own token beside the most likely ones, as vLLM's."""
        names = [self._name(s.token) for s in prompt]
        offs, pos = [], 0
        for x in names:
            offs.append(pos)
            pos += len(x)
        tops = []
        for s in prompt:
            if s.logprob is None or not seq.params.top_logprobs:
                tops.append(None)
                continue
            top = self._top_dict(s.top)
            top.setdefault(self._name(s.token), s.logprob)
            tops.append(top)
        return P.CompletionLogprobs(tokens=names, token_logprobs=[s.logprob for s in prompt],
                                    top_logprobs=tops, text_offset=offs)

    def _echo(self, i: int, out_prompt: Optional[list[Sampled]], text: str, lp):
        """Choice i's text and logprobs with its prompt in front (completions' echo)."""
        prompt_text = self.echo[i]
        if lp is not None and out_prompt is not None:
            head = self._prompt_logprobs(self.seqs[i], out_prompt)
            lp = P.CompletionLogprobs(head.tokens + lp.tokens, head.token_logprobs + lp.token_logprobs,
                                      head.top_logprobs + lp.top_logprobs,
                                      head.text_offset + [len(prompt_text) + o for o in lp.text_offset])
        return prompt_text + text, lp

    def _logprobs(self, tokens: list[Sampled], seq: Sequence, offset: int):
        if not seq.params.logprobs:
            return None
        name = self._name
        if self.chat:
            return P.ChoiceLogprobs([P.ChatCompletionTokenLogprob(
                name(s.token), s.logprob, top_logprobs=[P.TopLogprob(name(i), lp) for i, lp in (s.top or [])])
                for s in tokens])
        return P.CompletionLogprobs(
            tokens=[name(s.token) for s in tokens], token_logprobs=[s.logprob for s in tokens],
            top_logprobs=[self._top_dict(s.top) for s in tokens],
            text_offset=[offset] * len(tokens))

    def chunk(self, i: int, out: StepOutput):
        """The chunk of choice `i` for its output `out`, or None when it carries nothing."""
        seq, usage = self.seqs[i], None
        if out.finish_reason is not None:
            self._done += 1
            self._completion += out.usage[1]
            if self._done == len(self.seqs):
                usage = P.CompletionUsage(self.prompt_tokens, self._completion, self.prompt_tokens + self._completion)
        echo = self.echo is not None and self._first[i]
        if not (echo or out.text or out.finish_reason is not None or (out.tokens and seq.params.logprobs)):
            return None
        lp = self._logprobs(out.tokens, seq, self._offset[i])
        if self.chat:
            delta = P.ChoiceDelta(content=out.text, role="assistant" if self._first[i] else None)
            c = P.ChatCompletionChunk(self.id, self.created, self.model,
                                      [P.ChatCompletionChunkChoice(i, delta, out.finish_reason, lp)], usage)
        else:
            text = out.text
            if echo:
                text, lp = self._echo(i, out.prompt_logprobs, text, lp)
                self._offset[i] += len(self.echo[i])
            c = P.Completion(self.id, self.created, self.model,
                             [P.CompletionChoice(i, text, out.finish_reason, lp, [s.token for s in out.tokens])],
                             usage)
        self._first[i], self._offset[i] = False, self._offset[i] + len(out.text)
        return c

    def response(self, outs: list[list[StepOutput]]):
        """The whole response from every output of every choice (outs[i]: those of seqs[i])."""
        choices, completion = [], 0
        for i, (seq_outs, seq) in enumerate(zip(outs, self.seqs)):
            text = "".join(o.text for o in seq_outs)
            tokens = [s for o in seq_outs for s in o.tokens]
            last = seq_outs[-1]
            completion += last.usage[1]
            lp = self._logprobs(tokens, seq, 0)
            ids = [s.token for s in tokens]
            if self.chat:
                choices.append(P.ChatCompletionChoice(i, P.ChatCompletionMessage("assistant", text),
                                                      last.finish_reason, lp, ids))
                continue
            if lp is not None:  # text offsets of each token in the returned text
                pos, offs = 0, []
                for o in seq_outs:
                    offs += [pos] * len(o.tokens)
                    pos += len(o.text)
                lp.text_offset = offs
            if self.echo is not None:
                text, lp = self._echo(i, seq_outs[0].prompt_logprobs, text, lp)
            choices.append(P.CompletionChoice(i, text, last.finish_reason, lp, ids))
        prompt = self.prompt_tokens
        usage = P.CompletionUsage(prompt, completion, prompt + completion)
        if self.chat:
            return P.ChatCompletion(self.id, self.created, self.model, choices, usage)
        return P.Completion(self.id, self.created, self.model, choices, usage)
