"""End-to-end properties: identity with transformers (greedy, batched, the embedded base),
sampling distributions, any base, the user's model untouched, inputs and files checked, the
layout and a whole clone."""
