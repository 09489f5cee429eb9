# The README's session: the shout worker's second version, which publishes nothing.
def process(event):
    return None
