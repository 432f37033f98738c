"""Images as both sides read them: decoding and each vision architecture's processing."""
