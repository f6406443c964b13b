"""Training the shipped tiny model family (`scripts/train_family.py`), and the model
builder the tests share with it. Not part of the installed runtime (`pip install .`
ships only `proxy`).

modelgen        Qwen3 model directories of chosen shapes (random weights for tests),
                the byte-level tokenizer, MASK_TOKEN
corpus          the Python standard library's own sources: file selection, held-out
                split, tokenised streams and training windows
lm              next-token training of a Qwen3 causal LM
dflash_objective  the block-diffusion objective of the DFlash drafter: anchors, block
                inputs, attention mask, decayed loss, per-depth accuracy
evaluate        held-out metrics of a whole family, shared by the trainer and the
                test that re-checks the shipped files
"""
