# a small character-level GPT on tinyshakespeare (examples/nanogpt/prepare.py), a few minutes on CPU
out_dir = "out-shakespeare-char-lightning"
max_steps = 500
eval_interval = 250
eval_iters = 8
batch_size = 16
block_size = 64
n_layer = 4
n_head = 4
n_embd = 128
learning_rate = 1e-3
