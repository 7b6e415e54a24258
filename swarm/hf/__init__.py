"""Hugging Face interchange: export a swarm checkpoint, start training from a HF model, upcycle a dense one.

    swarm-export runs/demo hf/demo                         # OlmoeForCausalLM dir + tokenizer (export.py)
    swarm-peer --config C --solo --init-from hf/demo       # train on from exported weights (init_from.py)
    swarm-upcycle dense-llama/ upcycled/ --experts 8       # dense Llama/Qwen3 -> MoE checkpoint (upcycle.py)

``architectures.py`` maps our model config to the HF class that computes the same function (OLMoE,
Qwen3-MoE or Mixtral, by ``model.qk_norm``) and back; ``run_checkpoint.py`` finds a checkpoint, its run
config and its tokenizer. Everything works offline: nothing here contacts the hub.
"""
