"""A stand-in S3 endpoint that checks each request's SigV4 signature with botocore.

s3rver does not verify SigV4 signatures, so the dist tests point the S3 store at this server to
make sure the requests curl signs are the ones AWS verifies. Answers 200 (with just enough XML for
the store to go on) when the signature matches, 403 and the canonical request when it does not.

With SESSION_TOKEN (temporary credentials), each request must also carry it as a signed
x-amz-security-token header.

usage: python3 sigv4_check.py PORT ACCESS_KEY SECRET_KEY REGION [SESSION_TOKEN]
"""
import http.server
import sys

from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

PORT, ACCESS_KEY, SECRET_KEY, REGION = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
TOKEN = sys.argv[5] if len(sys.argv) > 5 else None


class Handler(http.server.BaseHTTPRequestHandler):
    def check(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        auth = self.headers.get("Authorization", "")
        ok, detail = False, "no SigV4 Authorization header"
        if "SignedHeaders=" in auth and "Signature=" in auth:
            signed = auth.split("SignedHeaders=")[1].split(",")[0].split(";")
            request = AWSRequest(method=self.command, url="http://" + self.headers["Host"] + self.path,
                                 data=body, headers={h: self.headers[h] for h in signed})
            request.context["timestamp"] = self.headers["x-amz-date"]
            signer = S3SigV4Auth(Credentials(ACCESS_KEY, SECRET_KEY, TOKEN), "s3", REGION)
            canonical = signer.canonical_request(request)
            expected = signer.signature(signer.string_to_sign(request, canonical), request)
            ok = expected == auth.split("Signature=")[1].strip()
            detail = canonical
            if ok and TOKEN and (self.headers.get("x-amz-security-token") != TOKEN
                                 or "x-amz-security-token" not in signed):
                ok, detail = False, "no signed x-amz-security-token header with the session token"
        if self.command == "POST" and "uploads=" in self.path:
            reply = b"<InitiateMultipartUploadResult><UploadId>u1</UploadId></InitiateMultipartUploadResult>"
        elif ok:
            reply = b"<ListBucketResult><IsTruncated>false</IsTruncated></ListBucketResult>"
        else:
            reply = ("<Error><Code>SignatureDoesNotMatch</Code><Message>" + detail.replace("\n", " | ") +
                     "</Message></Error>").encode()
        self.send_response(200 if ok else 403)
        self.send_header("ETag", '"etag"')
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(reply)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = check

    def log_message(self, *args):
        pass


http.server.HTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
