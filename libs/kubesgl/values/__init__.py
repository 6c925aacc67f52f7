"""The engine's public values, on the bottom floor: what a request asks for (`sampling.SamplingParams`) and
what the engine reports (`outputs.RequestOutput`, `TokenLogprob`, `FinishReason`, `ModelInfo`, `EngineStats`).

Pure Python, importing nothing of the engine (nor torch), so the wire protocol and the CPU-only services use
the same types the engine takes and gives.
"""
