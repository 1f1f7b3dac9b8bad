"""placeholder while the capture is built"""
class DecodeReport(list):
    pass
def check_decode(gen, steps, **kw):
    raise NotImplementedError
