"""Ceilings on what one request may ask of an engine, in a module without torch: the router and the gateway check
requests against them (`pdserve.router.limits`, the gateway's logprobs) and stay torch-free processes (about
200 MB of RSS each)."""

MAX_TOP_LOGPROBS = 20
# Ceilings on the stop conditions every decode step checks (the router's configurable limits stay within them)
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 300  # OpenAI's ceiling on logit_bias entries
MAX_REPETITION_PENALTY = 2.0
MAX_STRUCTURED_CHARS = 65536  # a JSON schema / regex / grammar / choice list, in characters
MAX_CHOICES = 256
MAX_N = 16  # GenerateRequest.n and best_of: sequences one request may fork into
