"""The checkpoint format: manifest, chunks, codecs, and the stream framing of both."""
