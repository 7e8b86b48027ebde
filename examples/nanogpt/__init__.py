"""A nanoGPT-style GPT and a script that trains it with nnscaler."""
