"""pdserve inference engine: loader, model, paged KV cache, scheduler, sampler, engine and its thread loop.

Submodules are imported explicitly (`from pdserve.engine.engine import LLMEngine`) so that importing the
package stays cheap.
"""
