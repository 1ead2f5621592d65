"""Local stand-ins for the AWS credential endpoints a pod on EKS talks to, on one loopback port:

  POST /                                              STS AssumeRoleWithWebIdentity (form body, XML reply)
  GET  /creds                                         container credentials (EKS Pod Identity, ECS; JSON)
  PUT  /latest/api/token                              IMDSv2 session token
  GET  /latest/meta-data/iam/security-credentials/    IMDSv2 role name, then .../ROLE: JSON credentials

Each request is appended to LOG as one JSON line (method, path, headers, form fields) for the test to
check. The n-th credentials handed out are ASIASTANDIN<n> / standin-secret-<n> / standin-token-<n>,
valid for LIFETIME seconds (--key and --secret fix the first two, e.g. to keys s3rver knows). --mode malformed answers 200 with a broken body; --mode error answers as
the real services do when they refuse.

usage: python3 aws_standin.py PORT LOG [--lifetime S] [--mode ok|malformed|error] [--key ID --secret KEY]
"""
import argparse
import datetime
import http.server
import json
import threading
import urllib.parse

ap = argparse.ArgumentParser()
ap.add_argument("port", type=int)
ap.add_argument("log")
ap.add_argument("--lifetime", type=int, default=3600)
ap.add_argument("--mode", default="ok", choices=["ok", "malformed", "error"])
ap.add_argument("--key", help="hand out this access key id (e.g. the one s3rver knows)")
ap.add_argument("--secret", help="and this secret access key")
a = ap.parse_args()

ROLE = "moerl-node-role"
IMDS_TOKEN = "imds-session-token-1"
lock = threading.Lock()
issued = 0


def next_credentials():
    global issued
    with lock:
        issued += 1
        n = issued
    expires = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0) + datetime.timedelta(
        seconds=a.lifetime)
    return {"AccessKeyId": a.key or f"ASIASTANDIN{n}", "SecretAccessKey": a.secret or f"standin-secret-{n}",
            "Token": f"standin-token-{n}", "Expiration": expires.strftime("%Y-%m-%dT%H:%M:%SZ")}


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def reply(self, status, body, content_type="application/json"):
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def record(self, form=None):
        with lock, open(a.log, "a") as f:
            f.write(json.dumps({"method": self.command, "path": self.path,
                                "headers": {k.lower(): v for k, v in self.headers.items()},
                                "form": form or {}}) + "\n")

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        form = {k: v[0] for k, v in urllib.parse.parse_qs(self.rfile.read(length).decode()).items()}
        self.record(form)
        if a.mode == "malformed":
            return self.reply(200, "<AssumeRoleWithWebIdentityResponse><SecretAccessKey>leaked-secret",
                              "text/xml")
        if a.mode == "error" or form.get("Action") != "AssumeRoleWithWebIdentity":
            return self.reply(400, "<ErrorResponse><Error><Type>Sender</Type><Code>InvalidIdentityToken</Code>"
                                   "<Message>Couldn't retrieve verification key from your identity provider"
                                   "</Message></Error><RequestId>1</RequestId></ErrorResponse>", "text/xml")
        c = next_credentials()
        self.reply(200, f"""<AssumeRoleWithWebIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">
  <AssumeRoleWithWebIdentityResult>
    <SubjectFromWebIdentityToken>system:serviceaccount:moerl:moerl</SubjectFromWebIdentityToken>
    <Credentials>
      <SessionToken>{c["Token"]}</SessionToken>
      <SecretAccessKey>{c["SecretAccessKey"]}</SecretAccessKey>
      <Expiration>{c["Expiration"]}</Expiration>
      <AccessKeyId>{c["AccessKeyId"]}</AccessKeyId>
    </Credentials>
  </AssumeRoleWithWebIdentityResult>
</AssumeRoleWithWebIdentityResponse>""", "text/xml")

    def do_PUT(self):
        self.record()
        if self.path != "/latest/api/token" or "X-aws-ec2-metadata-token-ttl-seconds" not in self.headers:
            return self.reply(400, "missing TTL", "text/plain")
        self.reply(200, IMDS_TOKEN, "text/plain")

    def do_GET(self):
        self.record()
        prefix = "/latest/meta-data/iam/security-credentials/"
        if self.path.startswith(prefix):
            if self.headers.get("X-aws-ec2-metadata-token") != IMDS_TOKEN:
                return self.reply(401, "", "text/plain")
            if self.path == prefix:
                return self.reply(200, ROLE + "\n", "text/plain")
            if self.path != prefix + ROLE:
                return self.reply(404, "", "text/plain")
        elif self.path != "/creds":
            return self.reply(404, "", "text/plain")
        if a.mode == "malformed":
            return self.reply(200, '{"AccessKeyId": "ASIA", "SecretAccessKey": "leaked-secret", ')
        if a.mode == "error":
            return self.reply(403, '{"code": "AccessDenied", "message": "the token is not valid"}')
        c = next_credentials()
        if self.path.startswith(prefix):
            c.update({"Code": "Success", "Type": "AWS-HMAC", "LastUpdated": c["Expiration"]})
        self.reply(200, json.dumps(c))

    def log_message(self, *args):
        pass


http.server.ThreadingHTTPServer(("127.0.0.1", a.port), Handler).serve_forever()
