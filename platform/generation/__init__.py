"""The generation service: one path from every front door (playground, /v1, batches) to the engine.

services.py   Generation, admit -> submit -> follow -> finish (quota, usage row, metrics)
result.py     Result: the one accumulator of a generation's engine events
catalog.py    which models live workers serve (requests are routed by model name)
tokenization.py  the served models' tokenizers in the web tier: chat templates, token counts
"""
