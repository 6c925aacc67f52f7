"""All choices of one client request (n > 1 and batched prompts fan out into child rids): admitted together,
their events merged into one stream, collected into ChoiceResults, and closed together."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from kubesgl.openai_api.responses import ChoiceResult
from kubesgl.services.gateway.generation import ChoiceEvent, ChoiceGeneration
from kubesgl.tool_formats import FORMATS, ToolCallFormat

_DONE = object()


class ChoiceGroup:
    def __init__(self, choices: list[ChoiceGeneration], rid: str, per_prompt: int = 1) -> None:
        self.choices = choices
        self.rid = rid  # the client's request id (choices carry `<rid>-<index>` when there are several)
        self._per_prompt = max(per_prompt, 1)

    def prompt_tokens(self) -> int:
        """Prompt tokens admitted, each prompt counted once however many choices it fanned out to."""
        firsts = self.choices[:: self._per_prompt]
        return sum(c.admitted.prompt_tokens for c in firsts if c.admitted is not None)

    def tool_format(self, index: int) -> ToolCallFormat | None:
        """How choice `index`'s output is parsed for tool calls: the format its tokenizer named when it
        admitted the request (None: not parsed, as without tools or with tool_choice "none")."""
        admitted = self.choices[index].admitted
        name = admitted.tool_format if admitted is not None else None
        return FORMATS.get(name) if name else None

    async def admit(self) -> None:
        """Admits every choice; if any is refused, the others are aborted and the refusal raised. A single
        choice (the common case) is awaited in place: no task and no gather per request."""
        try:
            if len(self.choices) == 1:
                await self.choices[0].admit()
            else:
                results = await asyncio.gather(*(c.admit() for c in self.choices), return_exceptions=True)
                failure = next((r for r in results if isinstance(r, BaseException)), None)
                if failure is not None:
                    raise failure
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for c in self.choices:
            c.close()

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Every choice's events as they come; the first failure of any choice fails the whole request."""
        if len(self.choices) == 1:
            async for event in self.choices[0].events():
                yield event
            return
        queue: asyncio.Queue[object] = asyncio.Queue()

        async def pump(choice: ChoiceGeneration) -> None:
            try:
                async for event in choice.events():
                    queue.put_nowait(event)
            except Exception as e:
                queue.put_nowait(e)
            queue.put_nowait(_DONE)

        tasks = [asyncio.create_task(pump(c)) for c in self.choices]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is _DONE:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    assert isinstance(item, ChoiceEvent)
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self) -> list[ChoiceResult]:
        """Runs every choice to its end (the non-streaming path)."""
        results = {c.index: ChoiceResult(c.index, "", None) for c in self.choices}
        for c in self.choices:
            if c.logprobs:
                results[c.index].logprobs = []
        async for event in self.events():
            r = results[event.index]
            r.text += event.text
            r.token_ids.extend(event.token_ids)
            if r.logprobs is not None and event.logprobs:
                r.logprobs.extend(event.logprobs)
            if event.prompt_logprobs is not None:
                r.prompt_logprobs = event.prompt_logprobs
            r.prompt_tokens = max(r.prompt_tokens, event.prompt_tokens)
            r.cached_tokens = max(r.cached_tokens, event.cached_tokens)
            r.completion_tokens = max(r.completion_tokens, event.completion_tokens)
            if event.finish_reason is not None:
                r.finish_reason, r.matched_stop = event.finish_reason, event.matched_stop
        return [results[i] for i in sorted(results)]
