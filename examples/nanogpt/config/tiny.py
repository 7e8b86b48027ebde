# a smoke run: a two-layer GPT for a few steps (seconds on CPU)
out_dir = "out-nanogpt-tiny"
max_steps = 20
eval_interval = 10
eval_iters = 2
batch_size = 8
block_size = 32
n_layer = 2
n_head = 2
n_embd = 32
learning_rate = 3e-3
sample_tokens = 60
