"""Images in requests: where they may come from, fetching, decoding, and the stage running them."""
