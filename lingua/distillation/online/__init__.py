"""The online road: students and teacher ranks of one launch talking over a bridge group each step.
Entered by the builder: `build_distiller` (student side) and `serve_teacher` (teacher side, from `apps.main.train`).

    distiller.py       OnlineDistiller: one bridge per online teacher (and any cached teacher's targets from the batch)
    bridge.py          the wire records (RequestHeader, HandshakeRecord, ResponseStatus) and the handshake
    client.py          TeacherClient: the student end of a bridge (handshake, submit -> handle.wait(), STOP)
    server.py          TeacherServer: load, handshake, then receive -> handle -> reply until STOP
    serving_clock.py   ServingClock (busy/idle seconds), TimeoutSwitch (the teacher's timeout, generous while the
                       students start up or announce a pause, short otherwise)
    replica.py         a tensor-parallel replica's ranks as one teacher: load records, the bridge spec, one round
                       per request shared with the followers
"""
