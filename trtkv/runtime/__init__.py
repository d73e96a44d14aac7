from trtkv.runtime.request import GenerationResult, StreamEvent
from trtkv.runtime.sampling import SamplingParams

__all__ = ["GenerationResult", "StreamEvent", "SamplingParams"]
