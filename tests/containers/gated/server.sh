#!/bin/sh
# A gated test container (busybox): records when it starts, serves HTTP on
# 127.0.0.1:PORT after DELAY (seconds, or a path: once that file exists), and
# records when the first readiness probe reached /cgi-bin/ready (the moment the
# gate saw it ready, before its slot is freed). Records: /records/NAME, one
# "EVENT SECONDS.MICROSECONDS" line each, on the wall clock (adjtimex:
# busybox's date has no sub-second format).
# Usage: server.sh NAME PORT DELAY
name=$1 port=$2 delay=$3
echo "start $(sh /gate/now.sh)" >> "/records/$name"
case $delay in
  /*) while [ ! -e "$delay" ]; do sleep 0.05; done ;;
  *) sleep "$delay" ;;
esac
mkdir -p /tmp/www/cgi-bin
cat > /tmp/www/cgi-bin/ready <<CGI
#!/bin/sh
[ -e /tmp/ready ] || { : > /tmp/ready; echo "ready \$(sh /gate/now.sh)" >> "/records/$name"; }
printf 'Content-Type: text/plain\r\n\r\nready\n'
CGI
chmod +x /tmp/www/cgi-bin/ready
exec httpd -f -p "127.0.0.1:$port" -h /tmp/www
