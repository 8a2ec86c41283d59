"""Speculative decoding that draws plain decoding's tokens: drafts searched in a slot's own
row, its group's and its prompt's past samples (drafts.py, history.py), verified in one
pass (decode.py), and the choice of speculating or not by live slots (choice.py)."""
