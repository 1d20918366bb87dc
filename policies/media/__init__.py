"""Media services the media policies share: the safe fetcher, data URIs, image/audio/video probing and
normalisation, modal-token estimates and the packaged screening models."""
