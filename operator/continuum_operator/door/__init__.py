"""A runtime's door, shared by the engine's gateway (`engine`) and an embed lane (`embed`),
neither of which imports the other: who a bearer token speaks for (`accounts`, pure) and the
TokenReview that says so, bounded against strangers (`token_review`), how the door is served,
its connections bounded, with the admin app beside it (`serving`), and how it reads a request's
body, in time and size (`body_limits`).
"""
